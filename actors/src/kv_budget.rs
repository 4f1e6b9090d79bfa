//! The consumer's bound on the memory its jobs' caches hold at once (`[limits] kv_mib`).
//!
//! A consumer rebuilds a cache for each job it decodes and keeps it until the job ends; the
//! decode loop steps every such job together. The scheduler gives a node no more than its
//! advertised capacity, but that is a count of jobs, and one long prompt holds as much as
//! many short ones. So before rebuilding a job's caches the consumer reserves their largest
//! size ([`scd_models::KvCache::peak_bytes`] of the prompt and every token the job may
//! generate, for each expert it decodes) from this budget, and holds the reservation until
//! the job ends. A job that does not fit is handed back (another consumer, or this one once
//! room is free), never queued here without bound.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

/// Reservations are counted in KiB: a semaphore counts in `u32`, and KiB keeps a budget of
/// terabytes countable while rounding each job up by less than a KiB.
const UNIT: u64 = 1024;

/// What a node's jobs' caches may hold at once.
#[derive(Debug, Clone)]
pub struct KvBudget {
    units: Arc<Semaphore>,
    total_units: u32,
}

/// A job's reservation; released when dropped.
#[derive(Debug)]
pub struct KvHold {
    _units: OwnedSemaphorePermit,
}

/// Why a job's caches cannot be reserved now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvRefusal {
    /// More than the whole budget: never on this node.
    #[error(
        "the job's caches need {need_mib} MiB, more than this node's [limits] kv_mib \
         ({limit_mib}); a shorter prompt or max_tokens, or a consumer with more, would do"
    )]
    TooLarge {
        /// What the job needs, MiB (rounded up).
        need_mib: u64,
        /// The node's budget, MiB.
        limit_mib: u64,
    },
    /// More than is free now: the jobs held use the rest.
    #[error(
        "the job's caches need {need_mib} MiB and {free_mib} MiB of this node's [limits] \
         kv_mib ({limit_mib}) are free"
    )]
    Busy {
        /// What the job needs, MiB (rounded up).
        need_mib: u64,
        /// What is free now, MiB.
        free_mib: u64,
        /// The node's budget, MiB.
        limit_mib: u64,
    },
}

impl KvBudget {
    /// A budget of `mib` MiB.
    pub fn new(mib: u64) -> Self {
        let total_units = u32::try_from(mib.saturating_mul(1024 * 1024) / UNIT)
            .unwrap_or(u32::MAX)
            .min(Semaphore::MAX_PERMITS as u32);
        Self {
            units: Arc::new(Semaphore::new(total_units as usize)),
            total_units,
        }
    }

    /// Reserves `bytes` until the hold is dropped, or says why not without waiting.
    pub fn reserve(&self, bytes: u64) -> Result<KvHold, KvRefusal> {
        let need = bytes.div_ceil(UNIT);
        let mib = |units: u64| (units * UNIT).div_ceil(1024 * 1024);
        let limit_mib = mib(u64::from(self.total_units));
        if need > u64::from(self.total_units) {
            return Err(KvRefusal::TooLarge {
                need_mib: mib(need),
                limit_mib,
            });
        }
        // `need` fits in u32: it is at most the total.
        match Arc::clone(&self.units).try_acquire_many_owned(need as u32) {
            Ok(units) => Ok(KvHold { _units: units }),
            Err(TryAcquireError::NoPermits | TryAcquireError::Closed) => Err(KvRefusal::Busy {
                need_mib: mib(need),
                free_mib: mib(self.units.available_permits() as u64),
                limit_mib,
            }),
        }
    }

    /// Bytes free now.
    pub fn free_bytes(&self) -> u64 {
        self.units.available_permits() as u64 * UNIT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn holds_are_bounded_and_released() {
        let budget = KvBudget::new(10);
        let a = budget.reserve(6 * MIB).unwrap();
        assert_eq!(budget.free_bytes(), 4 * MIB);
        assert_eq!(
            budget.reserve(5 * MIB).unwrap_err(),
            KvRefusal::Busy {
                need_mib: 5,
                free_mib: 4,
                limit_mib: 10
            }
        );
        let b = budget.reserve(4 * MIB).unwrap();
        assert_eq!(budget.free_bytes(), 0);
        drop(a);
        drop(b);
        assert_eq!(budget.free_bytes(), 10 * MIB);
        // A byte over a KiB takes two: rounding never lets more through than the budget.
        let _c = budget.reserve(1025).unwrap();
        assert_eq!(budget.free_bytes(), 10 * MIB - 2048);
    }

    #[test]
    fn a_job_over_the_whole_budget_is_too_large_not_busy() {
        let budget = KvBudget::new(1);
        let refusal = budget.reserve(MIB + 1).unwrap_err();
        assert_eq!(
            refusal,
            KvRefusal::TooLarge {
                need_mib: 2,
                limit_mib: 1
            }
        );
        assert!(refusal.to_string().contains("[limits] kv_mib (1)"));
    }
}
