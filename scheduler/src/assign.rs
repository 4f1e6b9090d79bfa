//! Assignment, as pure functions over the live membership (no I/O; the leader calls them and
//! writes the results).
//!
//! Pools: every expert model gets a pool of producer nodes that run its base model. Each expert
//! has a demand (expected load, 1.0 by default) that is split evenly over its pool, and a
//! producer's utilisation is the demand it carries divided by its capacity. Pools are
//! * stable: members that are still eligible stay; the result fed back in is a fixed point;
//! * repaired minimally: a departed member is replaced in the pools it was in, nothing else;
//! * balanced: after filling, an entry moves from a busier producer to a less busy one only when
//!   the receiver stays at or below the giver afterwards (so a newcomer takes over a fair share,
//!   and moves never cycle: `sum(demand^2 / capacity)` strictly falls with each).
//!
//! Per job: [`choose_producer`] prefers the pool member holding the longest prefix of the
//! prompt, then the least loaded.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::membership::{NodeInfo, NodeMap};
use scd_types::NodeId;

/// One expert model to build a pool for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertSpec {
    /// The expert model id.
    pub expert: String,
    /// The base model whose producers compute its prompts' state.
    pub base_model: String,
    /// How many producers its pool should hold (fewer when fewer are eligible).
    pub pool_size: usize,
    /// Expected load relative to other experts.
    pub demand: f64,
}

impl ExpertSpec {
    /// An expert with demand 1.
    pub fn new(expert: impl Into<String>, base_model: impl Into<String>, pool_size: usize) -> Self {
        Self {
            expert: expert.into(),
            base_model: base_model.into(),
            pool_size,
            demand: 1.0,
        }
    }
}

/// Pools by expert id; each pool is a sorted list of producer node ids.
pub type Pools = BTreeMap<String, Vec<NodeId>>;

const EPS: f64 = 1e-9;

struct Producer<'a> {
    node: &'a NodeInfo,
    carried: f64,
}

impl Producer<'_> {
    fn capacity(&self) -> f64 {
        f64::from(self.node.capacity.max(1))
    }

    fn utilisation(&self) -> f64 {
        self.carried / self.capacity()
    }

    fn live_load(&self) -> f64 {
        f64::from(self.node.load) / self.capacity()
    }
}

/// Computes every expert's pool from the live producers, keeping `previous` where possible.
pub fn compute_pools(nodes: &NodeMap, experts: &[ExpertSpec], previous: &Pools) -> Pools {
    let mut producers: BTreeMap<&str, Producer<'_>> = nodes
        .values()
        .filter(|n| n.capacity > 0 && !n.producer_models.is_empty())
        .map(|n| {
            (
                n.id.as_str(),
                Producer {
                    node: n,
                    carried: 0.0,
                },
            )
        })
        .collect();

    struct Plan<'a> {
        spec: &'a ExpertSpec,
        eligible: Vec<NodeId>,
        target: usize,
        share: f64,
        members: Vec<NodeId>,
    }

    let mut plans: Vec<Plan<'_>> = experts
        .iter()
        .map(|spec| {
            let eligible: Vec<NodeId> = producers
                .values()
                .filter(|p| p.node.producer_models.iter().any(|m| m == &spec.base_model))
                .map(|p| p.node.id.clone())
                .collect();
            let target = spec.pool_size.max(1).min(eligible.len());
            let share = if target == 0 {
                0.0
            } else {
                spec.demand.max(0.0) / target as f64
            };
            let mut members: Vec<NodeId> = previous
                .get(&spec.expert)
                .into_iter()
                .flatten()
                .filter(|id| eligible.contains(id))
                .cloned()
                .collect();
            members.sort();
            members.dedup();
            Plan {
                spec,
                eligible,
                target,
                share,
                members,
            }
        })
        .collect();

    for plan in &plans {
        for id in &plan.members {
            if let Some(p) = producers.get_mut(id.as_str()) {
                p.carried += plan.share;
            }
        }
    }

    // Shrink pools that are now too large, dropping their busiest members.
    for plan in &mut plans {
        while plan.members.len() > plan.target {
            let Some(pos) = busiest(&plan.members, &producers) else {
                break;
            };
            let id = plan.members.remove(pos);
            if let Some(p) = producers.get_mut(id.as_str()) {
                p.carried -= plan.share;
            }
        }
    }

    // Fill vacancies; the most constrained experts choose first.
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by(|&a, &b| {
        plans[a]
            .eligible
            .len()
            .cmp(&plans[b].eligible.len())
            .then_with(|| plans[a].spec.expert.cmp(&plans[b].spec.expert))
    });
    for &i in &order {
        while plans[i].members.len() < plans[i].target {
            let plan = &plans[i];
            let pick = plan
                .eligible
                .iter()
                .filter(|id| !plan.members.contains(id))
                .filter_map(|id| producers.get(id.as_str()))
                .min_by(|a, b| {
                    let ua = (a.carried + plan.share) / a.capacity();
                    let ub = (b.carried + plan.share) / b.capacity();
                    ua.total_cmp(&ub)
                        .then_with(|| a.live_load().total_cmp(&b.live_load()))
                        .then_with(|| a.node.id.cmp(&b.node.id))
                })
                .map(|p| p.node.id.clone());
            let Some(id) = pick else { break };
            if let Some(p) = producers.get_mut(id.as_str()) {
                p.carried += plans[i].share;
            }
            plans[i].members.push(id);
        }
    }

    // Rebalance with single moves while one strictly helps; bounded for safety.
    let max_moves = plans.iter().map(|p| p.target).sum::<usize>() * 4 + 8;
    for _ in 0..max_moves {
        let mut best: Option<(f64, usize, NodeId, NodeId)> = None;
        for (i, plan) in plans.iter().enumerate() {
            if plan.share <= 0.0 {
                continue;
            }
            for giver in &plan.members {
                let Some(g) = producers.get(giver.as_str()) else {
                    continue;
                };
                let giver_after = (g.carried - plan.share) / g.capacity();
                for taker in plan.eligible.iter().filter(|id| !plan.members.contains(id)) {
                    let Some(t) = producers.get(taker.as_str()) else {
                        continue;
                    };
                    let taker_after = (t.carried + plan.share) / t.capacity();
                    if taker_after <= giver_after + EPS {
                        let gain = g.utilisation() - taker_after;
                        let better = match &best {
                            None => true,
                            Some((b, bi, bg, bt)) => {
                                gain > *b + EPS
                                    || ((gain - *b).abs() <= EPS
                                        && (i, giver, taker) < (*bi, bg, bt))
                            }
                        };
                        if better {
                            best = Some((gain, i, giver.clone(), taker.clone()));
                        }
                    }
                }
            }
        }
        let Some((_, i, giver, taker)) = best else {
            break;
        };
        let share = plans[i].share;
        if let Some(p) = producers.get_mut(giver.as_str()) {
            p.carried -= share;
        }
        if let Some(p) = producers.get_mut(taker.as_str()) {
            p.carried += share;
        }
        plans[i].members.retain(|m| m != &giver);
        plans[i].members.push(taker);
    }

    plans
        .into_iter()
        .map(|mut plan| {
            plan.members.sort();
            (plan.spec.expert.clone(), plan.members)
        })
        .collect()
}

fn busiest(members: &[NodeId], producers: &BTreeMap<&str, Producer<'_>>) -> Option<usize> {
    members
        .iter()
        .enumerate()
        .filter_map(|(i, id)| producers.get(id.as_str()).map(|p| (i, p)))
        .max_by(|(_, a), (_, b)| {
            a.utilisation()
                .total_cmp(&b.utilisation())
                .then_with(|| a.node.id.cmp(&b.node.id))
        })
        .map(|(i, _)| i)
}

/// How many memberships differ between two pool sets (added plus removed).
pub fn pool_changes(before: &Pools, after: &Pools) -> usize {
    let experts: HashSet<&String> = before.keys().chain(after.keys()).collect();
    let empty = Vec::new();
    experts
        .into_iter()
        .map(|e| {
            let b = before.get(e).unwrap_or(&empty);
            let a = after.get(e).unwrap_or(&empty);
            b.iter().filter(|id| !a.contains(id)).count()
                + a.iter().filter(|id| !b.contains(id)).count()
        })
        .sum()
}

/// The producer chosen for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerChoice {
    /// Its node id.
    pub producer: NodeId,
    /// How many leading prompt blocks it already holds.
    pub matched_blocks: usize,
    /// How many of the job's documents it holds compiled.
    pub held_documents: usize,
}

/// Picks a producer for a job from `pool`: live members not in `exclude` (and, for a job that
/// names `documents`, that serve documents), preferring ones with spare capacity; among those,
/// the most of the job's documents held compiled wins, then the longest held prefix of
/// `prompt_hashes` (chained block hashes, see [`crate::prefix`]), then the lowest load per
/// capacity, then the id.
pub fn choose_producer(
    pool: &[NodeId],
    nodes: &NodeMap,
    prompt_hashes: &[String],
    documents: &[String],
    exclude: &[NodeId],
) -> Option<ProducerChoice> {
    let candidates: Vec<&NodeInfo> = pool
        .iter()
        .filter(|id| !exclude.contains(id))
        .filter_map(|id| nodes.get(id))
        .filter(|n| documents.is_empty() || n.document_writer.is_some())
        .collect();
    let with_room: Vec<&NodeInfo> = candidates
        .iter()
        .copied()
        .filter(|n| n.load < n.capacity)
        .collect();
    let candidates = if with_room.is_empty() {
        candidates
    } else {
        with_room
    };
    candidates
        .into_iter()
        .map(|n| {
            let held: HashSet<&str> = n.prefix_hashes.iter().map(String::as_str).collect();
            let matched = prompt_hashes
                .iter()
                .take_while(|h| held.contains(h.as_str()))
                .count();
            let docs = documents.iter().filter(|d| n.documents.contains(d)).count();
            (n, (docs, matched))
        })
        .min_by(|(a, ma), (b, mb)| {
            mb.cmp(ma)
                .then_with(|| load_ratio(a).total_cmp(&load_ratio(b)))
                .then_with(|| a.id.cmp(&b.id))
        })
        .map(|(n, (docs, matched))| ProducerChoice {
            producer: n.id.clone(),
            matched_blocks: matched,
            held_documents: docs,
        })
}

/// Picks the consumer for a job's experts (one, or several for a fan-out, all decoded on one
/// node from one code stream): a live node that decodes every one of them, least loaded
/// first, avoiding the `excluded` ones (consumers that lost the job before) while another
/// hosts them.
pub fn choose_consumer<S: AsRef<str>>(
    experts: &[S],
    nodes: &NodeMap,
    excluded: &[NodeId],
) -> Option<NodeId> {
    let hosts = || {
        nodes.values().filter(|n| {
            experts
                .iter()
                .all(|e| n.consumer_models.iter().any(|m| m == e.as_ref()))
        })
    };
    let fresh = hosts().any(|n| !excluded.contains(&n.id));
    hosts()
        .filter(|n| !fresh || !excluded.contains(&n.id))
        .min_by(|a, b| {
            load_ratio(a)
                .total_cmp(&load_ratio(b))
                .then_with(|| a.id.cmp(&b.id))
        })
        .map(|n| n.id.clone())
}

fn load_ratio(n: &NodeInfo) -> f64 {
    f64::from(n.load) / f64::from(n.capacity.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn producer(id: &str, capacity: u32, bases: &[&str]) -> NodeInfo {
        let mut n = NodeInfo::new(NodeId::new(id).unwrap(), "127.0.0.1:1", capacity);
        n.producer_models = bases.iter().map(|b| b.to_string()).collect();
        n
    }

    fn ids(list: &[&str]) -> Vec<NodeId> {
        list.iter().map(|id| NodeId::new(*id).unwrap()).collect()
    }

    fn nodes(list: Vec<NodeInfo>) -> NodeMap {
        list.into_iter().map(|n| (n.id.clone(), n)).collect()
    }

    fn experts(n: usize, pool_size: usize) -> Vec<ExpertSpec> {
        (0..n)
            .map(|i| ExpertSpec::new(format!("e{i}"), "base", pool_size))
            .collect()
    }

    fn memberships(pools: &Pools, id: &str) -> usize {
        pools.values().filter(|m| m.iter().any(|x| x == id)).count()
    }

    #[test]
    fn pools_are_full_and_balanced() {
        let ns = nodes(
            (0..4)
                .map(|i| producer(&format!("p{i}"), 4, &["base"]))
                .collect(),
        );
        let pools = compute_pools(&ns, &experts(6, 2), &Pools::new());
        assert_eq!(pools.len(), 6);
        assert!(pools.values().all(|m| m.len() == 2));
        let counts: Vec<usize> = (0..4)
            .map(|i| memberships(&pools, &format!("p{i}")))
            .collect();
        assert_eq!(counts.iter().sum::<usize>(), 12);
        assert!(counts.iter().all(|&c| c == 3), "{counts:?}");
    }

    #[test]
    fn capacity_weights_the_share() {
        let ns = nodes(vec![
            producer("big", 8, &["base"]),
            producer("small", 2, &["base"]),
        ]);
        let pools = compute_pools(&ns, &experts(10, 1), &Pools::new());
        assert_eq!(memberships(&pools, "big"), 8);
        assert_eq!(memberships(&pools, "small"), 2);
    }

    #[test]
    fn only_producers_of_the_base_model_are_eligible() {
        let mut consumer = NodeInfo::new(NodeId::from_static("c"), "x", 4);
        consumer.consumer_models = vec!["e0".into()];
        let ns = nodes(vec![
            producer("a", 4, &["base"]),
            producer("b", 4, &["other"]),
            consumer,
        ]);
        let pools = compute_pools(&ns, &experts(1, 3), &Pools::new());
        assert_eq!(pools["e0"], vec!["a".to_string()]);
        let none = compute_pools(&ns, &[ExpertSpec::new("x", "missing", 2)], &Pools::new());
        assert!(none["x"].is_empty());
    }

    #[test]
    fn stable_when_nothing_changes() {
        let ns = nodes(
            (0..5)
                .map(|i| producer(&format!("p{i}"), 1 + i % 3, &["base"]))
                .collect(),
        );
        let first = compute_pools(&ns, &experts(7, 2), &Pools::new());
        let second = compute_pools(&ns, &experts(7, 2), &first);
        assert_eq!(first, second);
        // Live load changes do not move anything either.
        let mut busy = ns.clone();
        for n in busy.values_mut() {
            n.load = n.capacity;
        }
        assert_eq!(compute_pools(&busy, &experts(7, 2), &first), first);
    }

    #[test]
    fn a_departure_only_moves_its_own_entries() {
        let ns = nodes(
            (0..3)
                .map(|i| producer(&format!("p{i}"), 4, &["base"]))
                .collect(),
        );
        let before = compute_pools(&ns, &experts(6, 2), &Pools::new());
        let mut fewer = ns.clone();
        fewer.remove("p1");
        let after = compute_pools(&fewer, &experts(6, 2), &before);
        for (expert, members) in &before {
            if members.iter().any(|m| m == "p1") {
                assert_eq!(after[expert].len(), 2);
                assert!(!after[expert].contains(&NodeId::from_static("p1")));
                let kept: Vec<_> = members.iter().filter(|m| *m != "p1").collect();
                assert!(
                    kept.iter().all(|k| after[expert].contains(k)),
                    "{expert}: kept members stay"
                );
            } else {
                assert_eq!(
                    &after[expert], members,
                    "{expert} did not contain p1 and must not change"
                );
            }
        }
        // Each lost membership is replaced once: removed + added.
        assert_eq!(
            pool_changes(&before, &after),
            2 * memberships(&before, "p1")
        );
    }

    #[test]
    fn a_newcomer_takes_a_fair_share_with_minimal_moves() {
        let ns = nodes(
            (0..2)
                .map(|i| producer(&format!("p{i}"), 4, &["base"]))
                .collect(),
        );
        let before = compute_pools(&ns, &experts(6, 1), &Pools::new());
        assert_eq!(memberships(&before, "p0"), 3);
        let mut more = ns.clone();
        more.insert(NodeId::from_static("p2"), producer("p2", 4, &["base"]));
        let after = compute_pools(&more, &experts(6, 1), &before);
        assert_eq!(memberships(&after, "p2"), 2);
        assert_eq!(memberships(&after, "p0"), 2);
        assert_eq!(memberships(&after, "p1"), 2);
        // Exactly two entries moved (each counted as one removal and one addition).
        assert_eq!(pool_changes(&before, &after), 4);
        // And the result is itself stable.
        assert_eq!(compute_pools(&more, &experts(6, 1), &after), after);
    }

    #[test]
    fn shrinking_a_pool_drops_the_busiest() {
        let ns = nodes(vec![
            producer("a", 1, &["base"]),
            producer("b", 10, &["base"]),
        ]);
        let previous: Pools = [("e0".to_string(), ids(&["a", "b"]))].into();
        let pools = compute_pools(&ns, &experts(1, 1), &previous);
        assert_eq!(pools["e0"], ids(&["b"]));
    }

    #[test]
    fn prefix_affinity_then_load() {
        let mut a = producer("a", 4, &["base"]);
        let mut b = producer("b", 4, &["base"]);
        let mut c = producer("c", 4, &["base"]);
        a.prefix_hashes = vec!["h0".into()];
        b.prefix_hashes = vec!["h0".into(), "h1".into()];
        b.load = 3;
        c.load = 0;
        let ns = nodes(vec![a.clone(), b.clone(), c.clone()]);
        let pool: Vec<NodeId> = ["a", "b", "c"].map(NodeId::from_static).to_vec();
        let prompt = vec!["h0".to_string(), "h1".to_string(), "h2".to_string()];
        let pick = choose_producer(&pool, &ns, &prompt, &[], &[]).unwrap();
        assert_eq!(
            pick,
            ProducerChoice {
                producer: NodeId::from_static("b"),
                matched_blocks: 2,
                held_documents: 0,
            }
        );
        // No affinity anywhere: least loaded wins.
        let pick = choose_producer(&pool, &ns, &["zz".to_string()], &[], &[]).unwrap();
        assert_eq!(pick.producer, "a");
        // A full producer loses to one with room, even with a longer prefix.
        b.load = 4;
        let ns = nodes(vec![a, b, c]);
        assert_eq!(
            choose_producer(&pool, &ns, &prompt, &[], &[])
                .unwrap()
                .producer,
            "a"
        );
        // Excluded or dead members are never chosen.
        assert_eq!(
            choose_producer(&pool, &ns, &prompt, &[], &ids(&["a"]))
                .unwrap()
                .producer,
            "c"
        );
        assert!(choose_producer(&ids(&["gone"]), &ns, &prompt, &[], &[]).is_none());
    }

    #[test]
    fn a_held_hash_only_counts_as_a_prefix_from_the_start() {
        let mut a = producer("a", 4, &["base"]);
        a.prefix_hashes = vec!["h1".into()];
        let b = producer("b", 4, &["base"]);
        let ns = nodes(vec![a, b]);
        let pick = choose_producer(
            &ids(&["a", "b"]),
            &ns,
            &["h0".into(), "h1".into()],
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(pick.matched_blocks, 0);
    }

    #[test]
    fn a_job_with_documents_goes_to_a_producer_serving_them_holding_the_most() {
        let mut a = producer("a", 4, &["base"]);
        let mut b = producer("b", 4, &["base"]);
        let mut c = producer("c", 4, &["base"]);
        let d = producer("d", 4, &["base"]);
        for n in [&mut a, &mut b, &mut c] {
            n.document_writer = Some("w1".into());
        }
        a.documents = vec!["d1".into()];
        b.documents = vec!["d1".into(), "d2".into()];
        b.load = 3;
        b.prefix_hashes = vec![];
        c.prefix_hashes = vec!["h0".into()];
        let pool: Vec<NodeId> = ["a", "b", "c", "d"].map(NodeId::from_static).to_vec();
        let ns = nodes(vec![a, b, c, d.clone()]);
        let docs = ["d1".to_string(), "d2".to_string()];
        // Held documents before prefix and load.
        let pick = choose_producer(&pool, &ns, &["h0".into()], &docs, &[]).unwrap();
        assert_eq!((pick.producer.as_str(), pick.held_documents), ("b", 2));
        // None held: any producer that serves documents, the prefix first; never one that
        // serves none, even idle.
        let other = ["d9".to_string()];
        let pick = choose_producer(&pool, &ns, &["h0".into()], &other, &[]).unwrap();
        assert_eq!((pick.producer.as_str(), pick.matched_blocks), ("c", 1));
        assert!(choose_producer(&ids(&["d"]), &ns, &[], &other, &[]).is_none());
        // A job without documents may go anywhere.
        let ns = nodes(vec![d]);
        assert!(choose_producer(&ids(&["d"]), &ns, &[], &[], &[]).is_some());
    }

    #[test]
    fn consumer_is_a_node_hosting_the_expert() {
        let mut c1 = NodeInfo::new(NodeId::from_static("c1"), "x", 2);
        c1.consumer_models = vec!["sotu".into()];
        c1.load = 2;
        let mut c2 = NodeInfo::new(NodeId::from_static("c2"), "x", 2);
        c2.consumer_models = vec!["sotu".into(), "law".into()];
        let ns = nodes(vec![c1, c2, producer("p", 1, &["base"])]);
        assert_eq!(choose_consumer(&["sotu"], &ns, &[]).as_deref(), Some("c2"));
        assert_eq!(choose_consumer(&["none"], &ns, &[]), None);
        // A fan-out goes to a node that hosts every one of its experts.
        assert_eq!(
            choose_consumer(&["sotu", "law"], &ns, &[]).as_deref(),
            Some("c2")
        );
        assert_eq!(choose_consumer(&["sotu", "none"], &ns, &[]), None);
        // A consumer that lost the job is avoided while another hosts the expert, and used
        // when it is the only one.
        let c2 = ids(&["c2"]);
        assert_eq!(choose_consumer(&["sotu"], &ns, &c2).as_deref(), Some("c1"));
        let both = ids(&["c1", "c2"]);
        assert_eq!(
            choose_consumer(&["sotu"], &ns, &both).as_deref(),
            Some("c2")
        );
        assert_eq!(choose_consumer(&["law"], &ns, &c2).as_deref(), Some("c2"));
    }
}
