//! A node's `/metrics` counts the cluster's jobs from the job follower's index, not from a
//! listing of the store.

use scd_actors::metrics::NodeMetrics;
use scd_scheduler::{JobId, JobRecord, JobState, Keys, Mode};

#[test]
fn cluster_jobs_follow_puts_and_deletes_without_a_listing() {
    let m = NodeMetrics::new();
    let keys = Keys::default();
    let [a, b, c] = [
        JobId::from_u128(1),
        JobId::from_u128(2),
        JobId::from_u128(3),
    ];
    let mut done = JobRecord::new(a, "sotu", Mode::Scd, 3);
    done.state = JobState::Done;
    m.cluster.put(&done);
    m.cluster.put(&JobRecord::new(b, "sotu", Mode::Scd, 3));
    m.cluster.put(&JobRecord::new(c, "sotu", Mode::Scd, 3));
    // A change replaces, a delete of the live key (archived) removes, an unknown key is
    // ignored.
    let mut assigned = JobRecord::new(c, "sotu", Mode::Scd, 3);
    assigned.state = JobState::Assigned;
    m.cluster.put(&assigned);
    m.cluster.remove_key(&keys.job(a));
    m.cluster.remove_key("/scd/v1/jobs/not-a-job-id");
    m.set_cluster_jobs();
    let text = m.render();
    assert!(
        text.contains("scd_cluster_jobs{state=\"queued\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("scd_cluster_jobs{state=\"assigned\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("scd_cluster_jobs{state=\"done\"} 0"),
        "{text}"
    );
    assert_eq!(m.cluster.len(), 2);
    m.cluster.clear();
    assert!(m.cluster.is_empty());
}
