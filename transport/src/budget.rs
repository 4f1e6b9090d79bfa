//! The node-wide receive budget: how many frame-body bytes all job streams of an endpoint, over
//! all its connections, may hold at once.
//!
//! A frame is charged for the memory its body buffer actually takes, as the buffer grows with
//! the bytes that arrive (see [`crate::framing`]); the charge goes with the frame
//! ([`crate::ReceivedFrame`]) and returns to the budget when the frame is dropped. So a peer that
//! announces a large frame and sends slowly holds budget for the buffer of what it sent (one
//! step, or up to about four times the bytes), not for what it announced.
//!
//! When a frame's buffer would grow past what is left, the frame **fails** with
//! [`BudgetError`]: its job is refused with [`crate::error_code::BUSY`] (the sender may retry
//! later or elsewhere) and its budget returns at once. It does not wait for room, because over
//! QUIC a wait can deadlock: a reader that waits stops reading its stream, the data the peer
//! already sent on it stays in quinn's buffers and counts against the connection's flow-control
//! window, and once waiting streams fill that window, the frames holding the budget on the same
//! connection cannot receive the rest of their bytes, so they never complete and never release
//! the budget the waiting ones need. (The test that showed it is in `tests/recv_memory.rs`.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A frame's buffer cannot grow within the budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    /// The frame's body alone is larger than the whole budget.
    #[error("frame body of {len} bytes exceeds the node's whole receive budget of {total} bytes")]
    FrameOverTotal {
        /// The frame's body length.
        len: u64,
        /// The budget.
        total: u64,
    },
    /// What is left of the budget cannot hold the next part of the frame's buffer.
    #[error("the node's receive budget is spent: {requested} more bytes wanted, {in_use} of {total} in use")]
    Exhausted {
        /// Bytes the buffer needed to grow by.
        requested: u64,
        /// Bytes in use when it asked.
        in_use: u64,
        /// The budget.
        total: u64,
    },
}

/// A snapshot of a budget's use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetStats {
    /// The budget in bytes.
    pub total: u64,
    /// Bytes held by frames now.
    pub in_use: u64,
    /// The most bytes held at once since the budget was made.
    pub high_water: u64,
    /// Frames refused so far because the budget was spent.
    pub refused: u64,
}

/// A byte budget shared by every reader of an endpoint. Cheap to clone (a handle).
#[derive(Debug, Clone)]
pub struct ReceiveBudget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    total: u64,
    in_use: AtomicU64,
    high_water: AtomicU64,
    refused: AtomicU64,
}

/// Bytes of the budget held by one frame; they return to the budget when this is dropped.
#[derive(Debug)]
pub struct BudgetShare {
    len: u64,
    budget: Arc<Inner>,
}

impl BudgetShare {
    /// The bytes held.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Hold `more` bytes, or fail without holding any more when they are not free now.
    pub fn grow(&mut self, more: u64) -> Result<(), BudgetError> {
        self.budget.charge(more)?;
        self.len += more;
        Ok(())
    }
}

impl Drop for BudgetShare {
    fn drop(&mut self) {
        self.budget.in_use.fetch_sub(self.len, Ordering::SeqCst);
    }
}

impl Inner {
    fn charge(&self, more: u64) -> Result<(), BudgetError> {
        let mut now = self.in_use.load(Ordering::SeqCst);
        loop {
            let next = now.saturating_add(more);
            if next > self.total {
                self.refused.fetch_add(1, Ordering::SeqCst);
                return Err(BudgetError::Exhausted {
                    requested: more,
                    in_use: now,
                    total: self.total,
                });
            }
            match self
                .in_use
                .compare_exchange(now, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    self.high_water.fetch_max(next, Ordering::SeqCst);
                    return Ok(());
                }
                Err(actual) => now = actual,
            }
        }
    }
}

impl ReceiveBudget {
    /// A budget of `total` bytes.
    pub fn new(total: u64) -> Self {
        Self {
            inner: Arc::new(Inner {
                total,
                in_use: AtomicU64::new(0),
                high_water: AtomicU64::new(0),
                refused: AtomicU64::new(0),
            }),
        }
    }

    /// The budget in bytes.
    pub fn total(&self) -> u64 {
        self.inner.total
    }

    /// How the budget is used now.
    pub fn stats(&self) -> BudgetStats {
        BudgetStats {
            total: self.inner.total,
            in_use: self.inner.in_use.load(Ordering::SeqCst),
            high_water: self.inner.high_water.load(Ordering::SeqCst),
            refused: self.inner.refused.load(Ordering::SeqCst),
        }
    }

    /// An empty share for a frame whose body is `len` bytes, to grow with its buffer; fails when
    /// the body could never fit.
    pub fn share_for(&self, len: u32) -> Result<BudgetShare, BudgetError> {
        if u64::from(len) > self.inner.total {
            self.inner.refused.fetch_add(1, Ordering::SeqCst);
            return Err(BudgetError::FrameOverTotal {
                len: len.into(),
                total: self.inner.total,
            });
        }
        Ok(BudgetShare {
            len: 0,
            budget: Arc::clone(&self.inner),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_grow_within_the_total_and_come_back_on_drop() {
        let b = ReceiveBudget::new(100);
        let mut a = b.share_for(80).unwrap();
        a.grow(60).unwrap();
        let mut c = b.share_for(50).unwrap();
        assert_eq!(
            c.grow(50),
            Err(BudgetError::Exhausted {
                requested: 50,
                in_use: 60,
                total: 100
            })
        );
        // A refused growth holds nothing more.
        assert_eq!(c.len(), 0);
        c.grow(40).unwrap();
        assert_eq!(b.stats().in_use, 100);
        drop(a);
        c.grow(10).unwrap();
        drop(c);
        assert_eq!(
            b.stats(),
            BudgetStats {
                total: 100,
                in_use: 0,
                high_water: 100,
                refused: 1
            }
        );
    }

    #[test]
    fn a_frame_larger_than_the_whole_budget_is_refused_up_front() {
        let b = ReceiveBudget::new(100);
        assert_eq!(
            b.share_for(101).unwrap_err(),
            BudgetError::FrameOverTotal {
                len: 101,
                total: 100
            }
        );
        assert_eq!(b.stats().refused, 1);
    }
}
