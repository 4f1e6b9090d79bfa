//! How a prompt's state reaches the expert that decodes it.

use std::fmt;
use std::str::FromStr;

use rkyv::{Archive, Deserialize as RkyvDeserialize, Serialize as RkyvSerialize};
use serde::{Deserialize, Serialize};

/// A transfer mode. Every mode runs through the same job path, so that they compare like with
/// like (see `docs/method.md` §1.8 and §4.1 for what each one is).
#[derive(
    Archive,
    RkyvSerialize,
    RkyvDeserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// No transfer: the expert runs its own prefill (the reference).
    Oracle,
    /// The base model's KV cache in bf16, used as is.
    Raw,
    /// The base model's KV cache quantised to 4 bits (KIVI-style groups with scales).
    Q4,
    /// Raw KV for most layers; a few layer blocks recomputed by the expert from the base's
    /// hidden state at the block's entry (DroidSpeak-style).
    #[serde(rename = "droidspeak")]
    DroidSpeak,
    /// SCD Reuse on every layer: low-rank codes decoded into the expert's feature space.
    Reuse,
    /// SCD: Reuse on most layers, Patch on a few critical ones.
    Scd,
    /// Not a way of sending: the job's producer picks one of the others when it claims the
    /// job (the lowest expected time to first token under the pair's quality ceiling) and
    /// the record then names that one.
    Auto,
    // Later modes go last, so that the wire's (rkyv's) numbers of the earlier ones stay.
    /// The base model's KV cache quantised to 2 bits (KIVI's 2-bit setting).
    Q2,
    /// The base model's KV cache transform-coded within the one model (KVTC-style: the base's
    /// own PCA basis, a step per component, entropy coding; no translation), at a rate.
    Kvtc,
}

impl Mode {
    /// Every way of sending, the reference first (not [`Mode::Auto`], which picks one).
    pub const ALL: [Mode; 8] = [
        Mode::Oracle,
        Mode::Raw,
        Mode::Q4,
        Mode::Q2,
        Mode::Kvtc,
        Mode::DroidSpeak,
        Mode::Reuse,
        Mode::Scd,
    ];

    /// The name used on the command line, in records and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Oracle => "oracle",
            Mode::Raw => "raw",
            Mode::Q4 => "q4",
            Mode::Q2 => "q2",
            Mode::Kvtc => "kvtc",
            Mode::DroidSpeak => "droidspeak",
            Mode::Reuse => "reuse",
            Mode::Scd => "scd",
            Mode::Auto => "auto",
        }
    }

    /// Whether the mode needs the model pair's calibration (a translator, which also holds
    /// DroidSpeak's recompute blocks and the base's own basis for `kvtc`).
    pub fn needs_translator(self) -> bool {
        matches!(
            self,
            Mode::Kvtc | Mode::DroidSpeak | Mode::Reuse | Mode::Scd
        )
    }

    /// Whether the mode's codes are made with the pair's translator (low-rank codes that only
    /// that translator version decodes): the codes carry its hash, their ranks can be chosen
    /// per job, and the drift guard checks them. DroidSpeak needs a translator too, but only for
    /// its recompute blocks: it sends raw KV.
    pub fn uses_translator_codes(self) -> bool {
        matches!(self, Mode::Reuse | Mode::Scd)
    }

    /// Whether the mode's codes decode only with the translator version that made them: the
    /// translator's own codes, and `kvtc`'s, coded in the base basis the translator stores.
    /// Their frames carry the version's hash, which the consumer checks.
    pub fn codes_tied_to_translator(self) -> bool {
        self.uses_translator_codes() || self == Mode::Kvtc
    }

    /// Whether a job in this mode may run on translator codes: one that does, or `auto`,
    /// which may pick one that does.
    pub fn may_use_translator_codes(self) -> bool {
        self.uses_translator_codes() || self == Mode::Auto
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A mode name nobody implements.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown transfer mode {0:?} (known: oracle, raw, q4, q2, kvtc, droidspeak, reuse, scd, auto)"
)]
pub struct ParseModeError(String);

impl FromStr for Mode {
    type Err = ParseModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mode::ALL
            .into_iter()
            .chain([Mode::Auto])
            .find(|m| m.as_str() == s)
            .ok_or_else(|| ParseModeError(s.to_owned()))
    }
}

impl ArchivedMode {
    /// The mode this archive holds.
    pub fn get(&self) -> Mode {
        match self {
            ArchivedMode::Oracle => Mode::Oracle,
            ArchivedMode::Raw => Mode::Raw,
            ArchivedMode::Q4 => Mode::Q4,
            ArchivedMode::Q2 => Mode::Q2,
            ArchivedMode::Kvtc => Mode::Kvtc,
            ArchivedMode::DroidSpeak => Mode::DroidSpeak,
            ArchivedMode::Reuse => Mode::Reuse,
            ArchivedMode::Scd => Mode::Scd,
            ArchivedMode::Auto => Mode::Auto,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_in_every_form() {
        for m in Mode::ALL.into_iter().chain([Mode::Auto]) {
            assert_eq!(m.as_str().parse::<Mode>().unwrap(), m);
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{m}\""));
            let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&m).unwrap();
            let a = rkyv::access::<ArchivedMode, rkyv::rancor::Error>(&bytes).unwrap();
            assert_eq!(a.get(), m);
        }
        let err = "reuse-only".parse::<Mode>().unwrap_err().to_string();
        assert!(err.contains("known: oracle"), "{err}");
        assert!(Mode::Scd.needs_translator() && !Mode::Q4.needs_translator());
        let coded: Vec<Mode> = Mode::ALL
            .into_iter()
            .filter(|m| m.uses_translator_codes())
            .collect();
        assert_eq!(coded, [Mode::Reuse, Mode::Scd]);
        let tied: Vec<Mode> = Mode::ALL
            .into_iter()
            .filter(|m| m.codes_tied_to_translator())
            .collect();
        assert_eq!(tied, [Mode::Kvtc, Mode::Reuse, Mode::Scd]);
        assert!(tied.iter().all(|m| m.needs_translator()));
        assert!(coded.iter().all(|m| m.needs_translator()));
    }
}
