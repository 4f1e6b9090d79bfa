//! The reference mode: no payload; the consumer runs its own prefill of the prefix.

use scd_types::{LayerCode, Mode};

use super::{kind_name, Codec, CodecError, LayerDecoder, Prefix};
use crate::cache::KvCache;
use crate::llama::{Capture, Input, LayerCapture, Llama, LogitsWanted};

/// The consumer's own prefill.
#[derive(Debug, Clone, Copy, Default)]
pub struct Oracle;

struct OracleDecoder<'a> {
    consumer: &'a Llama,
    prefix: Prefix<'a>,
}

impl Codec for Oracle {
    fn mode(&self) -> Mode {
        Mode::Oracle
    }

    fn capture(&self) -> Option<Capture> {
        None
    }

    fn encode_layer(&self, _: &LayerCapture, _: &mut Vec<LayerCode>) -> Result<(), CodecError> {
        Ok(())
    }

    fn decoder<'a>(
        &'a self,
        consumer: &'a Llama,
        prefix: Prefix<'a>,
    ) -> Result<Box<dyn LayerDecoder + 'a>, CodecError> {
        Ok(Box::new(OracleDecoder { consumer, prefix }))
    }
}

impl LayerDecoder for OracleDecoder<'_> {
    fn push(&mut self, code: &LayerCode) -> Result<(), CodecError> {
        Err(CodecError::UnexpectedCode {
            mode: Mode::Oracle,
            layer: code.layer,
            kind: kind_name(code.kind),
        })
    }

    fn finish(self: Box<Self>) -> Result<KvCache, CodecError> {
        let mut cache = self.consumer.new_cache();
        cache.set_next_position(self.prefix.start_pos);
        if !self.prefix.tokens.is_empty() {
            self.consumer.forward(
                Input::new(self.prefix.tokens)
                    .with_cache(&mut cache)
                    .logits(LogitsWanted::None),
            )?;
        }
        Ok(cache)
    }
}
