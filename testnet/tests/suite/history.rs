//! The GPU history behind the dashboard's plots, on a real node: samples keep coming
//! while the local API is asked many times a second (the event loop's tick runs on a
//! fixed cadence, whatever else arrives), and a restart keeps what was sampled.

use std::time::{Duration, Instant};

use gpunode_node::NodeConfig;
use testnet::{start_node, start_node_in, TestNetConfig};

fn one_second_samples(_: usize, c: &mut NodeConfig) {
    c.history_step = Duration::from_secs(1);
}

fn samples(node: &testnet::TestNode) -> usize {
    node.handle
        .history()
        .read(|h| h.gpus().first().map_or(0, |g| g.hour.len()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_api_does_not_starve_the_history_and_a_restart_keeps_it() {
    let cfg = TestNetConfig {
        tweak: Some(one_second_samples),
        ..TestNetConfig::new(vec![Some("1xA100-80GB".into())])
    };
    let spec = Some("1xA100-80GB".to_string());
    let node = start_node(&cfg, 0, spec.as_ref(), &[])
        .await
        .expect("start");
    // Ask for the status every 20 ms, far more often than the loop's 1 s tick, until three
    // samples are in (4 s at one a second; a starved history never gets there).
    let until = Instant::now() + Duration::from_secs(30);
    while samples(&node) < 3 {
        assert!(
            Instant::now() < until,
            "only {} samples in 30 s at one a second",
            samples(&node)
        );
        node.handle.status().await.expect("status");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = samples(&node);

    let dir = node.stop_keeping_data().await;
    assert!(dir
        .path()
        .join(gpunode_node::history::HISTORY_FILE)
        .exists());
    let again = start_node_in(&cfg, 0, spec.as_ref(), &[], dir)
        .await
        .expect("restart");
    assert!(samples(&again) >= before, "the restart lost the samples");
    let report = again.handle.utilization();
    assert_eq!(report.gpus.len(), 1);
    assert!(report.gpus[0].simulated);
    assert!(report.machine[0].hours_sampled > 0.0);
}
