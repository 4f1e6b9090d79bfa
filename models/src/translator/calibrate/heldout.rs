//! Step 4 of a calibration: the held-out prompts' caches one way or another (raw, Reuse,
//! Patch, DroidSpeak's recomputed blocks), and the choices made by their KL.

use candle_core::Tensor;
use serde_json::json;

use super::capture::{capture_all, need, LayerStats};
use super::fit_layers::Fitted;
use super::{CalibrateEvent, PatchChoice, Setup};
use crate::cache::KvCache;
use crate::llama::{Capture, Llama, Proj};
use crate::translator::low_rank::{fit, FitOptions};
use crate::translator::select::{greedy, knee, CurvePoint, HeldOutPrompt};
use crate::translator::TranslatorError;
// Calibration measures its candidates' codes in f32 whatever the machine, so that a
// translator's choices (centring, ridge, Patch layers) reproduce on machines with and without
// AMX; serving runs the codes on the machine's prefill path (`codec::translated`).
use crate::prefill_matmul::PrefillMatmul::F32;

/// The K and V a held-out prompt's consumer cache gets at one layer, one way or another.
type Kv = (Tensor, Tensor);

/// One layer of a held-out cache: the producer's as it serves it (keys rotated with its RoPE,
/// which an expert with its own base reads wrongly), or one the consumer's side derived (rotated
/// with the consumer's own).
enum HeldKv {
    Served(Kv),
    Own(Kv),
}

/// Everything measured on one held-out prompt for one consumer, per layer.
struct HeldOutLayers {
    prompt: HeldOutPrompt,
    raw: Vec<Kv>,
    reuse: Vec<Kv>,
    patch: Vec<Kv>,
    /// DroidSpeak: per block start, the block's layers as the consumer computes them.
    blocks: Vec<Vec<Kv>>,
}

impl HeldOutLayers {
    /// The consumer's cache with each layer from `pick` (Reuse where it gives `None`).
    fn cache(
        &self,
        consumer: &Llama,
        pick: impl Fn(usize) -> Result<Option<HeldKv>, TranslatorError>,
    ) -> Result<KvCache, TranslatorError> {
        let positions: Vec<u32> = (0..self.prompt.prefix.len() as u32).collect();
        let served = consumer.base_rope().tables(&positions)?;
        let own = consumer.rope().tables(&positions)?;
        let mut cache = consumer.new_cache();
        for l in 0..consumer.config().num_layers {
            let (tables, (k, v)) = match pick(l)? {
                Some(HeldKv::Served(kv)) => (&served, kv),
                Some(HeldKv::Own(kv)) => (&own, kv),
                None => (&own, self.reuse[l].clone()),
            };
            cache.fill_layer_rotating(tables, l, &k, &v)?;
        }
        Ok(cache)
    }
}

/// Which layer a held-out cache takes from where (`None`: Reuse).
type Pick<'p> = &'p dyn Fn(&HeldOutLayers, usize) -> Option<HeldKv>;

/// The held-out measurements of every consumer: per consumer, per held-out prompt.
pub(super) struct HeldOut<'a> {
    /// `(name, model)`, as [`Setup::consumers`].
    consumers: &'a [(&'a str, &'a Llama)],
    prompts: Vec<Vec<HeldOutLayers>>,
}

impl HeldOut<'_> {
    /// Mean held-out KL over consumers and the prompts `which` takes, with each layer taken
    /// from `pick`.
    fn kl_of(&self, which: &dyn Fn(usize) -> bool, pick: Pick) -> Result<f64, TranslatorError> {
        let mut total = 0.0;
        let mut n = 0usize;
        for ((_, consumer), prompts) in self.consumers.iter().zip(&self.prompts) {
            for (_, h) in prompts.iter().enumerate().filter(|(i, _)| which(*i)) {
                total += h
                    .prompt
                    .kl(consumer, h.cache(consumer, |l| Ok(pick(h, l)))?)?;
                n += 1;
            }
        }
        Ok(total / n.max(1) as f64)
    }

    /// [`HeldOut::kl_of`] over every prompt.
    fn kl(&self, pick: Pick) -> Result<f64, TranslatorError> {
        self.kl_of(&|_| true, pick)
    }
}

/// Runs the producer over each of `held_prompts` (as each consumer's [`HeldOutPrompt`]) and
/// keeps, per consumer, prompt and layer, the K and V the consumer's cache would get raw, by
/// Reuse and by Patch at the default ranks, and for DroidSpeak each block's layers as the
/// consumer recomputes them from the producer's hidden state.
///
/// Returns them with the consumers, ready for the KL of any mix of layers.
pub(super) fn measure<'a>(
    setup: &Setup<'a>,
    fitted: &Fitted,
    held_prompts: &[Vec<u32>],
) -> Result<HeldOut<'a>, TranslatorError> {
    let (cfg, layers, m) = (setup.cfg, setup.layers, setup.m);
    let Fitted {
        k_codes,
        v_codes,
        h_codes,
        aligners,
        ..
    } = fitted;
    let dr = cfg.default_ranks;
    let block = setup.droidspeak_block();
    let block_starts = layers + 1 - block;
    let mut held: Vec<Vec<HeldOutLayers>> = Vec::with_capacity(m);
    for (e, (_, consumer)) in setup.consumers.iter().enumerate() {
        let mut per_prompt_layers = Vec::with_capacity(held_prompts.len());
        for tokens in held_prompts {
            let prompt = HeldOutPrompt::new(consumer, tokens, cfg.heldout_continuation)?;
            let caps = capture_all(setup.producer, &prompt.prefix)?;
            let (mut raw, mut reuse, mut patch) = (Vec::new(), Vec::new(), Vec::new());
            for (l, c) in caps.iter().enumerate() {
                let (k, v, h) = (
                    need(&c.k_pre_rope, "K")?,
                    need(&c.v, "V")?,
                    need(&c.h_in, "H_in")?,
                );
                raw.push((k.clone(), v.clone()));
                reuse.push((
                    k_codes[l].decode(&k_codes[l].encode(k, dr.k, F32)?, e, F32)?,
                    v_codes[l].decode(&v_codes[l].encode(v, dr.v, F32)?, e, F32)?,
                ));
                let hb = aligners[l][e].forward(&h_codes[l].encode(h, dr.h, F32)?, F32)?;
                patch.push((
                    consumer.project(l, Proj::K, &hb)?,
                    consumer.project(l, Proj::V, &hb)?,
                ));
            }
            let mut blocks = Vec::with_capacity(block_starts);
            for (s, cap) in caps.iter().enumerate().take(block_starts) {
                let hidden_in = need(&cap.hidden, "hidden")?;
                let mut cache = consumer.new_cache();
                let mut own = Vec::new();
                consumer.forward_layers_capture(
                    hidden_in,
                    s..s + block,
                    0,
                    Some(&mut cache),
                    &Capture {
                        k_pre_rope: true,
                        v: true,
                        ..Capture::none()
                    },
                    &mut own,
                )?;
                blocks.push(
                    own.iter()
                        .map(|c| Ok((need(&c.k_pre_rope, "K")?.clone(), need(&c.v, "V")?.clone())))
                        .collect::<Result<Vec<_>, TranslatorError>>()?,
                );
            }
            per_prompt_layers.push(HeldOutLayers {
                prompt,
                raw,
                reuse,
                patch,
                blocks,
            });
        }
        held.push(per_prompt_layers);
    }
    Ok(HeldOut {
        consumers: setup.consumers,
        prompts: held,
    })
}

/// The held-out KL of raw transfer and of Reuse at the default ranks.
pub(super) struct Baseline {
    pub(super) kl_raw: f64,
    pub(super) kl_reuse: f64,
    /// The same on the chat turns and on the running text apart (`null` unless the prompts
    /// mix both).
    pub(super) by_kind: serde_json::Value,
}

/// Measures [`Baseline`] on `held` and notes it.
pub(super) fn baseline(
    setup: &Setup<'_>,
    held: &HeldOut<'_>,
    on_event: &mut impl FnMut(&CalibrateEvent),
) -> Result<Baseline, TranslatorError> {
    let (cfg, dr) = (setup.cfg, setup.cfg.default_ranks);
    let kl_raw = held.kl(&|h, l| Some(HeldKv::Served(h.raw[l].clone())))?;
    let kl_reuse = held.kl(&|_, _| None)?;
    on_event(&CalibrateEvent::Note(format!(
        "held-out KL: raw {kl_raw:.4}, reuse at ranks {}/{} {kl_reuse:.4}",
        dr.k, dr.v
    )));
    // The same on the chat turns and on the running text apart: what the mix costs or buys
    // on each kind of prompt.
    let by_kind = match &cfg.chat {
        Some(chat) if chat.share > 0.0 && chat.share < 1.0 => {
            let mut kinds = serde_json::Map::new();
            for (name, is_chat) in [("chat", true), ("text", false)] {
                let which = |i: usize| chat.wraps(i) == is_chat;
                let raw = held.kl_of(&which, &|h, l| Some(HeldKv::Served(h.raw[l].clone())))?;
                let reuse = held.kl_of(&which, &|_, _| None)?;
                on_event(&CalibrateEvent::Note(format!(
                    "held-out KL on {name} prompts: raw {raw:.4}, reuse {reuse:.4}"
                )));
                kinds.insert(name.into(), json!({"kl_raw": raw, "kl_reuse": reuse}));
            }
            serde_json::Value::Object(kinds)
        }
        _ => serde_json::Value::Null,
    };
    Ok(Baseline {
        kl_raw,
        kl_reuse,
        by_kind,
    })
}

/// The Patch layers chosen, and the curve they were chosen from.
pub(super) struct PatchLayers {
    /// The greedy curve, the empty set first.
    pub(super) curve: Vec<CurvePoint>,
    /// The point of `curve` kept.
    pub(super) knee: usize,
    /// The layers of that point, sorted.
    pub(super) layers: Vec<usize>,
    /// Every layer the curve tried, in the order chosen (the translator stores the Patch
    /// code of each).
    pub(super) order: Vec<usize>,
}

/// Chooses the Patch layers greedily by held-out KL (the rest Reuse), and keeps as many as
/// `cfg.patch` says: up to the curve's knee, or a fixed count. Notes each point of the curve.
pub(super) fn choose_patch_layers(
    setup: &Setup<'_>,
    held: &HeldOut<'_>,
    on_event: &mut impl FnMut(&CalibrateEvent),
) -> Result<PatchLayers, TranslatorError> {
    let (cfg, layers) = (setup.cfg, setup.layers);
    let max_patch = match &cfg.patch {
        PatchChoice::Auto { max, .. } => *max,
        PatchChoice::Fixed(k) => *k,
    }
    .min(layers);
    let patch_curve = greedy(
        layers,
        max_patch,
        cfg.shortlist,
        |_, _| true,
        |set| held.kl(&|h, l| set.contains(&l).then(|| HeldKv::Own(h.patch[l].clone()))),
        |p| {
            on_event(&CalibrateEvent::Note(format!(
                "patch {:?}: KL {:.4}",
                p.chosen, p.kl
            )))
        },
    )?;
    let k = match &cfg.patch {
        PatchChoice::Auto { min_share, .. } => knee(&patch_curve, *min_share),
        PatchChoice::Fixed(k) => (*k).min(patch_curve.len() - 1),
    };
    let mut patch_layers = patch_curve[k].chosen.clone();
    patch_layers.sort_unstable();
    let patch_order = patch_curve
        .last()
        .map(|p| p.chosen.clone())
        .unwrap_or_default();
    Ok(PatchLayers {
        curve: patch_curve,
        knee: k,
        layers: patch_layers,
        order: patch_order,
    })
}

/// DroidSpeak's recompute blocks, and the curve they were chosen from.
pub(super) struct DroidSpeakBlocks {
    /// The greedy curve of block starts, the empty set first.
    pub(super) curve: Vec<CurvePoint>,
    /// The blocks of the curve's last point as layer ranges `(start, end)`, sorted.
    pub(super) blocks: Vec<(usize, usize)>,
}

/// Chooses up to `cfg.droidspeak_blocks` non-overlapping blocks of layers for DroidSpeak's
/// consumer to recompute, greedily by held-out KL (the other layers raw). Notes each point of
/// the curve.
pub(super) fn choose_droidspeak_blocks(
    setup: &Setup<'_>,
    held: &HeldOut<'_>,
    on_event: &mut impl FnMut(&CalibrateEvent),
) -> Result<DroidSpeakBlocks, TranslatorError> {
    let cfg = setup.cfg;
    let block = setup.droidspeak_block();
    let block_starts = setup.layers + 1 - block;
    let ds_curve = greedy(
        block_starts,
        cfg.droidspeak_blocks,
        cfg.shortlist,
        |chosen, s| chosen.iter().all(|&c| s + block <= c || c + block <= s),
        |starts| {
            held.kl(&|h, l| {
                starts
                    .iter()
                    .find(|&&s| (s..s + block).contains(&l))
                    .map(|&s| HeldKv::Own(h.blocks[s][l - s].clone()))
                    .or_else(|| Some(HeldKv::Served(h.raw[l].clone())))
            })
        },
        |p| {
            on_event(&CalibrateEvent::Note(format!(
                "droidspeak {:?}: KL {:.4}",
                p.chosen, p.kl
            )))
        },
    )?;
    let mut droidspeak_blocks: Vec<(usize, usize)> = ds_curve
        .last()
        .map(|p| p.chosen.iter().map(|&s| (s, s + block)).collect())
        .unwrap_or_default();
    droidspeak_blocks.sort_unstable();
    Ok(DroidSpeakBlocks {
        curve: ds_curve,
        blocks: droidspeak_blocks,
    })
}

/// Refits the Reuse codes of K and V from `stats` with and without centring at a few ridge
/// strengths, and measures each on `held` (Reuse only, default ranks): a record of how the
/// choice compares, which changes nothing in the translator.
///
/// Returns one `{centre, ridge, kl}` per setting, and notes each.
pub(super) fn compare_centring_ridge(
    setup: &Setup<'_>,
    held: &HeldOut<'_>,
    stats: &[LayerStats],
    on_event: &mut impl FnMut(&CalibrateEvent),
) -> Result<Vec<serde_json::Value>, TranslatorError> {
    let dr = setup.cfg.default_ranks;
    let widths_kv: Vec<usize> = vec![setup.kv; setup.m + 1];
    let mut sweep = Vec::new();
    for centre in [true, false] {
        for ridge in [1e-6, 1e-4, 1e-2, 1e-1] {
            let o = FitOptions {
                centre,
                ridge,
                rank: dr.k.max(dr.v),
            };
            let codes = stats
                .iter()
                .map(|st| Ok((fit(&st.k, &widths_kv, o)?, fit(&st.v, &widths_kv, o)?)))
                .collect::<Result<Vec<_>, TranslatorError>>()?;
            let mut total = 0.0;
            let mut n = 0usize;
            for (e, ((_, consumer), prompts)) in
                held.consumers.iter().zip(&held.prompts).enumerate()
            {
                for h in prompts {
                    let cache = h.cache(consumer, |l| {
                        let (kc, vc) = &codes[l];
                        let (k, v) = &h.raw[l];
                        Ok(Some(HeldKv::Own((
                            kc.decode(&kc.encode(k, dr.k, F32)?, e, F32)?,
                            vc.decode(&vc.encode(v, dr.v, F32)?, e, F32)?,
                        ))))
                    })?;
                    total += h.prompt.kl(consumer, cache)?;
                    n += 1;
                }
            }
            let v = total / n.max(1) as f64;
            on_event(&CalibrateEvent::Note(format!(
                "reuse, centre {centre}, ridge {ridge:e}: KL {v:.4}"
            )));
            sweep.push(json!({"centre": centre, "ridge": ridge, "kl": v}));
        }
    }
    Ok(sweep)
}
