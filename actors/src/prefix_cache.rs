//! The producer's prefix cache: what the base model computed for prompt prefixes it prefilled
//! before, in blocks of whole tokens, so that a prompt starting with a cached prefix is
//! prefilled from where the cache ends.
//!
//! Blocks are content-addressed by the chained hashes of [`scd_scheduler::prefix`] (one hash
//! names a block and everything before it), so a hit is the longest run of a prompt's leading
//! blocks that the cache holds. A block keeps, per layer, everything a codec may capture for its
//! tokens (K before RoPE, V, `H_in`, the residual stream): the cache holds base-model state, and
//! codes are still made per job, so one cached prefix serves every expert and every mode.
//! Memory is bounded: past the budget the least recently used blocks go (a hit touches every
//! block of its run, so a block is never used more recently than the one before it).
//!
//! The node advertises the hashes it holds in its registration; the scheduler sends a prompt to
//! the producer that holds the longest run of its blocks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use tokio::sync::watch;

/// One layer of a cached block: `(block_tokens, width)` rows.
#[derive(Debug, Clone)]
pub struct LayerRows {
    /// K before RoPE.
    pub k_pre_rope: Tensor,
    /// V.
    pub v: Tensor,
    /// `H_in`.
    pub h_in: Tensor,
    /// The residual stream entering the layer.
    pub hidden: Tensor,
}

impl LayerRows {
    fn bytes(&self) -> usize {
        [&self.k_pre_rope, &self.v, &self.h_in, &self.hidden]
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

/// A cached block: its layers, in order.
#[derive(Debug)]
pub struct Block {
    /// Per layer.
    pub layers: Vec<LayerRows>,
}

struct Entry {
    block: Arc<Block>,
    bytes: usize,
    last_used: u64,
}

#[derive(Default)]
struct Inner {
    blocks: HashMap<String, Entry>,
    bytes: usize,
    clock: u64,
}

impl Inner {
    /// Marks a run of leading blocks used now, the first the most recently: eviction then
    /// takes a chain from its end.
    fn touch(&mut self, run: &[String]) {
        for h in run.iter().rev() {
            self.clock += 1;
            let now = self.clock;
            if let Some(e) = self.blocks.get_mut(h) {
                e.last_used = now;
            }
        }
    }
}

/// What the cache has done, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prefills that found at least one block.
    pub hits: u64,
    /// Prefills that found none (prompts shorter than a block count too).
    pub misses: u64,
    /// Prompt tokens taken from the cache instead of computed.
    pub tokens_reused: u64,
    /// Blocks held now.
    pub blocks: u64,
    /// Bytes held now.
    pub bytes: u64,
}

/// A producer's prefix cache.
pub struct PrefixCache {
    model_id: String,
    block_tokens: usize,
    budget_bytes: usize,
    inner: Mutex<Inner>,
    hits: AtomicU64,
    misses: AtomicU64,
    tokens_reused: AtomicU64,
    /// Bumped whenever the set of blocks changes (the node re-advertises its hashes).
    changed: watch::Sender<u64>,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("model_id", &self.model_id)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl PrefixCache {
    /// An empty cache for base model `model_id` (the hashes' namespace), in blocks of
    /// `block_tokens`, holding at most `budget_bytes`.
    pub fn new(model_id: &str, block_tokens: usize, budget_bytes: usize) -> Self {
        Self {
            model_id: model_id.to_owned(),
            block_tokens: block_tokens.max(1),
            budget_bytes,
            inner: Mutex::new(Inner::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            tokens_reused: AtomicU64::new(0),
            changed: watch::channel(0).0,
        }
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The chained hashes of `prefix`'s whole blocks.
    pub fn hashes(&self, prefix: &[u32]) -> Vec<String> {
        scd_scheduler::prefix::block_hashes(&self.model_id, prefix, self.block_tokens)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The longest run of leading blocks of `hashes` the cache holds (touched as used), and
    /// the lookup counted as a hit or a miss.
    pub fn lookup(&self, hashes: &[String]) -> Vec<Arc<Block>> {
        let mut inner = self.lock();
        let run: Vec<Arc<Block>> = hashes
            .iter()
            .map_while(|h| inner.blocks.get(h).map(|e| e.block.clone()))
            .collect();
        inner.touch(&hashes[..run.len()]);
        drop(inner);
        if run.is_empty() {
            self.misses.fetch_add(1, Ordering::Relaxed);
        } else {
            self.hits.fetch_add(1, Ordering::Relaxed);
            self.tokens_reused
                .fetch_add((run.len() * self.block_tokens) as u64, Ordering::Relaxed);
        }
        run
    }

    /// Adds the blocks of a prompt whose chained hashes are `chain`: `new` holds each block
    /// with its index in `chain`, in order. Least recently used blocks of other prompts go
    /// until each fits; where only this chain's own blocks are left, the rest of it is not
    /// kept (a block is of use only after the ones before it). Then the chain is touched, so
    /// that no block of it is older than a block after it.
    pub fn insert_chain(&self, chain: &[String], new: Vec<(usize, Block)>) {
        let mut inner = self.lock();
        let mut added = false;
        let own: std::collections::HashSet<&String> = chain.iter().collect();
        // The new blocks are newer than anything held, the chain's first the newest: had they
        // the oldest stamp, a prompt larger than the room left would evict its own first
        // blocks to make room for its later ones, and keep nothing a lookup could hit.
        let newest = inner.clock + chain.len() as u64;
        inner.clock = newest;
        for (i, block) in new {
            let Some(hash) = chain.get(i) else { continue };
            let bytes: usize = block.layers.iter().map(LayerRows::bytes).sum();
            if inner.blocks.contains_key(hash) {
                continue;
            }
            let mut fits = bytes <= self.budget_bytes;
            while fits && inner.bytes + bytes > self.budget_bytes {
                let oldest = inner
                    .blocks
                    .iter()
                    .filter(|(h, _)| !own.contains(h))
                    .min_by_key(|(_, e)| e.last_used)
                    .map(|(h, _)| h.clone());
                match oldest.and_then(|h| inner.blocks.remove(&h)) {
                    Some(e) => inner.bytes -= e.bytes,
                    None => fits = false,
                }
            }
            if !fits {
                break;
            }
            inner.bytes += bytes;
            inner.blocks.insert(
                hash.clone(),
                Entry {
                    block: Arc::new(block),
                    bytes,
                    last_used: newest - i as u64,
                },
            );
            added = true;
        }
        let present = chain
            .iter()
            .take_while(|h| inner.blocks.contains_key(*h))
            .count();
        inner.touch(&chain[..present]);
        drop(inner);
        if added {
            self.changed.send_modify(|v| *v += 1);
        }
    }

    /// The hashes held, most recently used first, at most `limit`.
    pub fn held(&self, limit: usize) -> Vec<String> {
        let inner = self.lock();
        let mut held: Vec<(&String, u64)> =
            inner.blocks.iter().map(|(h, e)| (h, e.last_used)).collect();
        held.sort_by_key(|&(_, used)| std::cmp::Reverse(used));
        held.into_iter()
            .take(limit)
            .map(|(h, _)| h.clone())
            .collect()
    }

    /// Told whenever the set of blocks changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Counters and sizes now.
    pub fn stats(&self) -> CacheStats {
        let inner = self.lock();
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            tokens_reused: self.tokens_reused.load(Ordering::Relaxed),
            blocks: inner.blocks.len() as u64,
            bytes: inner.bytes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn block(layers: usize, tokens: usize) -> Block {
        let t = Tensor::zeros((tokens, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        Block {
            layers: (0..layers)
                .map(|_| LayerRows {
                    k_pre_rope: t.clone(),
                    v: t.clone(),
                    h_in: t.clone(),
                    hidden: t.clone(),
                })
                .collect(),
        }
    }

    /// 2 layers x 4 tensors x 2 tokens x 4 floats x 4 bytes.
    const BLOCK_BYTES: usize = 2 * 4 * 2 * 4 * 4;

    #[test]
    fn a_hit_is_the_longest_leading_run_and_the_budget_evicts_the_least_recently_used() {
        let cache = PrefixCache::new("base", 2, 3 * BLOCK_BYTES);
        let prompt: Vec<u32> = (0..9).collect();
        let hashes = cache.hashes(&prompt);
        assert_eq!(hashes.len(), 4, "a trailing partial block is not hashed");
        assert!(cache.lookup(&hashes).is_empty());
        cache.insert_chain(&hashes, (0..3).map(|i| (i, block(2, 2))).collect());
        assert_eq!(cache.lookup(&hashes).len(), 3);
        // Another prompt sharing the first block only.
        let other = cache.hashes(&[0, 1, 7, 7, 7, 7]);
        assert_eq!(other[0], hashes[0]);
        assert_eq!(cache.lookup(&other).len(), 1);
        // Over budget: the least recently used block (the third) goes.
        cache.insert_chain(&other, vec![(1, block(2, 2))]);
        assert_eq!(cache.lookup(&hashes).len(), 2);
        let s = cache.stats();
        assert_eq!((s.blocks, s.bytes), (3, 3 * BLOCK_BYTES as u64));
        assert_eq!((s.hits, s.misses), (3, 1));
        assert_eq!(s.tokens_reused, 2 * (3 + 1 + 2));
        // A block over the whole budget is not kept; other models' hashes differ.
        let tiny = PrefixCache::new("base", 2, BLOCK_BYTES - 1);
        tiny.insert_chain(&hashes, vec![(0, block(2, 2))]);
        assert_eq!(tiny.stats().blocks, 0);
        assert_ne!(PrefixCache::new("other", 2, 0).hashes(&prompt), hashes);
        assert_eq!(cache.held(2).len(), 2);
    }

    /// A prompt larger than the room left evicts other prompts' blocks, never its own first
    /// ones; past the whole budget it keeps the leading blocks that fit.
    #[test]
    fn a_new_prompt_keeps_its_leading_blocks() {
        let cache = PrefixCache::new("base", 2, 3 * BLOCK_BYTES);
        let first = cache.hashes(&(0..4).collect::<Vec<u32>>());
        cache.insert_chain(&first, (0..2).map(|i| (i, block(2, 2))).collect());
        let second = cache.hashes(&(100..106).collect::<Vec<u32>>());
        cache.insert_chain(&second, (0..3).map(|i| (i, block(2, 2))).collect());
        assert_eq!(
            cache.lookup(&second).len(),
            3,
            "the new prompt is held whole"
        );
        assert!(cache.lookup(&first).is_empty(), "the older one made room");
        let long = cache.hashes(&(200..210).collect::<Vec<u32>>());
        cache.insert_chain(&long, (0..5).map(|i| (i, block(2, 2))).collect());
        assert_eq!(
            cache.lookup(&long).len(),
            3,
            "its first three blocks, not its last"
        );
        assert_eq!(cache.stats().bytes, 3 * BLOCK_BYTES as u64);
    }
}
