//! Container jobs between real nodes on 127.0.0.1: a `--host-env` job and an image job
//! run under bubblewrap on a provider with simulated GPUs, see only the leased GPU,
//! send their outputs back and settle; a provider that does not allow `--host-env`
//! refuses it with a reason.

use std::time::Duration;

use gpunode_node::jobs::ContainerRequest;
use gpunode_node::{LeaseSpec, NodeConfig};
use gpunode_protocol::job::JobOutcome;
use testnet::jobs::{request, run_to_end, stdout_of};
use testnet::TestNet;

const LONG: Duration = Duration::from_secs(60);

fn containers(i: usize, c: &mut NodeConfig) {
    c.backends = vec!["wasm".into(), "container".into()];
    // Provider 0 lends its own system to container jobs; provider 1 only runs images.
    c.allow_host_env = i == 0;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_jobs_see_only_their_gpu_and_settle() {
    let net = TestNet::gpu_providers(&["2xA100-80GB"; 2])
        .tweak(containers)
        .with_clients(1)
        .clients_see_offers(LONG)
        .start()
        .await
        .expect("start");
    let client = net.client(0);
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("in.txt");
    std::fs::write(&input, "data from the requester").expect("input");

    // --host-env on provider 0, one GPU.
    let req = request("sh".into(), &dir.path().join("out1"))
        .container(ContainerRequest {
            image: None,
            command: vec![
                "sh".into(),
                "-c".into(),
                "echo \"gpus=$CUDA_VISIBLE_DEVICES\"; cat /input/in.txt; echo; echo done > /output/result.txt"
                    .into(),
            ],
        })
        .input(input.clone())
        .gpus(1)
        .peer(net.provider_id(0));
    let (events, end) = run_to_end(&client.handle, req, LONG).await.expect("run");
    let summary = end.expect("the host-env job succeeds");
    assert_eq!(summary.outcome, JobOutcome::Exited(0));
    let stdout = String::from_utf8(stdout_of(&events)).expect("utf-8");
    let gpus: Vec<&str> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("gpus="))
        .expect("the gpu line")
        .split(',')
        .collect();
    assert_eq!(gpus.len(), 1, "exactly the leased GPU: {stdout}");
    assert!(gpus[0].starts_with("GPU-sim-"), "{stdout}");
    assert!(stdout.contains("data from the requester"), "{stdout}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out1/result.txt")).expect("result"),
        "done\n"
    );
    assert_eq!(summary.receipt, "settled", "{summary:?}");

    // An image job on provider 1: its default command runs inside the image.
    let image = dir.path().join("shell.tar");
    testnet::images::shell_image(
        &image,
        &[
            "/bin/sh",
            "-c",
            "echo from the image; echo img > /output/img.txt",
        ],
    )
    .expect("image");
    let req = request(image.clone(), &dir.path().join("out2"))
        .container(ContainerRequest {
            image: Some(image),
            command: Vec::new(),
        })
        .peer(net.provider_id(1));
    let (events, end) = run_to_end(&client.handle, req, LONG).await.expect("run");
    let summary = end.expect("the image job succeeds");
    assert_eq!(summary.outcome, JobOutcome::Exited(0));
    assert_eq!(stdout_of(&events), b"from the image\n");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out2/img.txt")).expect("img"),
        "img\n"
    );

    // Provider 1 does not lend its own system.
    let req = request("sh".into(), &dir.path().join("out3"))
        .container(ContainerRequest {
            image: None,
            command: vec!["true".into()],
        })
        .peer(net.provider_id(1))
        .retries(0);
    let (_, end) = run_to_end(&client.handle, req, LONG).await.expect("run");
    let error = end.expect_err("refused");
    assert!(error.contains("does not allow --host-env"), "{error}");
    net.shutdown().await;
}

fn mig_provider(_: usize, c: &mut NodeConfig) {
    c.backends = vec!["wasm".into(), "container".into()];
    c.allow_host_env = true;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_slice_is_leased_as_a_unit_of_its_own() {
    let net = TestNet::gpu_providers(&["1xA100-80GB@3x2g.20gb"])
        .tweak(mig_provider)
        .with_clients(1)
        .clients_see_offers(LONG)
        .start()
        .await
        .expect("start");
    let client = net.client(0);
    let provider = net.provider_id(0);
    let dir = tempfile::tempdir().expect("tempdir");

    let req = request("sh".into(), dir.path())
        .container(ContainerRequest {
            image: None,
            command: vec![
                "sh".into(),
                "-c".into(),
                "echo \"$CUDA_VISIBLE_DEVICES\"".into(),
            ],
        })
        .gpus(1)
        .gpu_slice("2g.20gb")
        .peer(provider.clone());
    let (events, end) = run_to_end(&client.handle, req, LONG).await.expect("run");
    end.expect("the slice job runs");
    let seen = String::from_utf8(stdout_of(&events)).expect("utf-8");
    assert!(
        seen.starts_with("MIG-sim-") && !seen.contains(','),
        "{seen}"
    );

    // A whole GPU is not there, and neither is another profile.
    let mut spec = LeaseSpec::new(1, 60_000).peer(&provider);
    let err = client
        .handle
        .request_lease(spec.clone())
        .await
        .expect_err("no whole GPU");
    assert!(err.to_string().contains("no GPU free"), "{err}");
    spec.gpu_slice = Some("1g.10gb".into());
    let err = client
        .handle
        .request_lease(spec.clone())
        .await
        .expect_err("no such slice");
    assert!(err.to_string().contains("no GPU free"), "{err}");
    // Three slices of the profile can be held at once, a fourth cannot.
    spec.gpu_slice = Some("2g.20gb".into());
    for _ in 0..3 {
        client
            .handle
            .request_lease(spec.clone())
            .await
            .expect("a slice");
    }
    client
        .handle
        .request_lease(spec)
        .await
        .expect_err("all three slices are leased");
    net.shutdown().await;
}
