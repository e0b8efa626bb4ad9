//! The web dashboard end to end: two real `gpunode serve` processes, real jobs, and
//! Debian's chromium (headless, driven by puppeteer-core from `tests/dashboard`) on the
//! requester's dashboard. The page must show the provider, a GPU plot with samples, a
//! waiting job with its reason and a verified receipt, and take the job's next state
//! live, without a reload. Also: the link's token is needed, a wrong `Host` and other
//! sites are refused, the routes are read-only, and a port in use does not stop the
//! daemon.
//!
//! `GPUNODE_SCREENSHOTS=docs/img cargo test -p gpunode-e2e --test e2e dashboard` also
//! writes the screenshots in `docs/img/`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpunode_e2e::{gpunode, gpunode_bin, stderr, stdout, workspace_file};
use gpunode_procs::process::ServeProcess;
use serde_json::Value;

/// Node's config for both daemons: a dashboard on a free port, a sample a second.
const CONFIG: &str =
    "max_connections_per_ip = 0\ndashboard_addr = \"127.0.0.1:0\"\nhistory_step = \"1s\"\n";

fn start(dir: &std::path::Path, extra: &[&str]) -> ServeProcess {
    std::fs::create_dir_all(dir).expect("dir");
    let config = dir.join("dashboard-test.toml");
    std::fs::write(&config, CONFIG).expect("config");
    let mut args: Vec<String> = vec!["--config".into(), config.display().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    ServeProcess::start(&gpunode_bin(), dir, &args).expect("serve")
}

/// `gpunode dashboard --no-open`: the link, once the daemon answers.
fn dashboard_url(data_dir: &std::path::Path) -> String {
    link_once_served(|| gpunode(data_dir, &["dashboard", "--no-open"]))
}

/// The link that `dashboard` (run by `run`) prints, once the daemon answers.
fn link_once_served(run: impl Fn() -> std::process::Output) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = run();
        if out.status.success() {
            return stdout(&out).trim().to_string();
        }
        assert!(
            Instant::now() < deadline,
            "no dashboard link: {}",
            stderr(&out)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits (up to 10 s) until the machine view at `addr` has a simulated GPU's plot: the
/// first sample is taken within a step of the start.
fn wait_for_gpu_plot(addr: &str, cookie: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, _, body) = get(addr, "/v1/machine", cookie);
        assert_eq!(code, 200);
        let machine: Value = serde_json::from_str(&body).expect("machine JSON");
        if machine["plots"][0]["simulated"] == true {
            return;
        }
        assert!(Instant::now() < deadline, "no GPU plot: {machine}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One raw HTTP/1.1 request; returns the status code, the headers and the body.
fn http(addr: &str, request: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(request.as_bytes()).expect("write");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, head.to_string(), body.to_string())
}

fn get(addr: &str, path: &str, headers: &str) -> (u16, String, String) {
    http(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{headers}\r\n"),
    )
}

#[test]
fn the_dashboard_refuses_what_is_not_its_own_page() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = gpunode(&tmp.path().join("none"), &["dashboard", "--no-open"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no gpunode daemon runs"),
        "{}",
        stderr(&out)
    );
    let node = start(&tmp.path().join("n"), &["--simulate-gpus", "1xT4-16GB"]);
    let url = dashboard_url(&node.data_dir);
    let rest = url.strip_prefix("http://").expect("http link");
    let (addr, token) = rest.split_once("/?token=").expect("token in the link");

    // The page itself is public (it holds no data); its data is not.
    assert_eq!(get(addr, "/", "").0, 200);
    assert_eq!(get(addr, "/v1/status", "").0, 401);
    assert_eq!(get(addr, "/events", "").0, 401);
    let wrong = "Authorization: Bearer 00000000000000000000000000000000\r\n";
    assert_eq!(get(addr, "/v1/status", wrong).0, 401);
    assert_eq!(get(addr, "/?token=nottheone", "").0, 401);
    // The link's token becomes a strict, script-proof cookie, and the cookie works.
    let (code, head, _) = get(addr, &format!("/?token={token}"), "");
    assert_eq!(code, 303, "{head}");
    let head = head.to_ascii_lowercase();
    assert!(
        head.contains("httponly") && head.contains("samesite=strict"),
        "{head}"
    );
    let cookie = format!("Cookie: gpunode_dashboard={token}\r\n");
    wait_for_gpu_plot(addr, &cookie);

    // DNS rebinding: the right token under another host name is refused.
    let (code, _, _) = http(
        addr,
        &format!("GET /v1/status HTTP/1.1\r\nHost: attacker.example:{}\r\nConnection: close\r\n{cookie}\r\n", addr.rsplit(':').next().unwrap_or("")),
    );
    assert_eq!(code, 421);
    // Another site's request is refused even where the browser sent the cookie.
    let cross = format!("{cookie}Sec-Fetch-Site: cross-site\r\n");
    assert_eq!(get(addr, "/v1/ledger", &cross).0, 403);
    // Read-only: what changes state is only on the owner's Unix socket.
    let post = format!(
        "POST /v1/jobs HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{cookie}Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
    );
    assert_eq!(http(addr, &post).0, 405);
    for path in [
        "/v1/team/invite",
        "/v1/leases/x/cancel",
        "/metrics",
        "/../config.toml",
    ] {
        let code = get(addr, path, &cookie).0;
        assert!(code == 404 || code == 405, "{path}: {code}");
    }

    // A second daemon whose dashboard port is taken still serves, and says why.
    let port = addr.rsplit(':').next().expect("port");
    let other = tmp.path().join("o");
    std::fs::create_dir_all(&other).expect("dir");
    let second = ServeProcess::start(
        &gpunode_bin(),
        &other,
        &["--dashboard-addr".into(), format!("127.0.0.1:{port}")],
    )
    .expect("a taken dashboard port does not stop the daemon");
    let out = gpunode(&second.data_dir, &["dashboard", "--no-open"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("port was in use"), "{}", stderr(&out));
    assert!(
        second.log().contains("no dashboard: cannot listen"),
        "{}",
        second.log()
    );
    // A dashboard address beyond loopback is refused before anything starts.
    let out = gpunode(
        &tmp.path().join("x"),
        &["serve", "--dashboard-addr", "0.0.0.0:4171"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not a loopback address"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_dashboard_turned_off_is_not_served_and_dashboard_says_so() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Off in the config file, and off by flag.
    let by_config = tmp.path().join("c");
    std::fs::create_dir_all(&by_config).expect("dir");
    let config = by_config.join("off.toml");
    std::fs::write(&config, "dashboard = false\n").expect("config");
    let by_flag = tmp.path().join("f");
    std::fs::create_dir_all(&by_flag).expect("dir");
    let daemons = [
        ServeProcess::start(
            &gpunode_bin(),
            &by_config,
            &["--config".into(), config.display().to_string()],
        )
        .expect("serve"),
        ServeProcess::start(&gpunode_bin(), &by_flag, &["--no-dashboard".into()]).expect("serve"),
    ];
    for daemon in &daemons {
        let status = gpunode(&daemon.data_dir, &["status", "--json"]);
        assert!(status.status.success(), "{}", stderr(&status));
        let status: Value = serde_json::from_str(&stdout(&status)).expect("status JSON");
        assert!(status["dashboard_url"].is_null(), "{status}");
        let out = gpunode(&daemon.data_dir, &["dashboard", "--no-open"]);
        assert_eq!(out.status.code(), Some(1));
        assert!(
            stderr(&out).contains("serves no dashboard: it is off (dashboard = false)"),
            "{}",
            stderr(&out)
        );
        // Off means never tried: no listener, and no complaint about a taken port.
        let log = daemon.log();
        assert!(!log.contains("dashboard on http://"), "{log}");
        assert!(!log.contains("no dashboard: cannot listen"), "{log}");
    }
}

/// `gpunode` as a user runs it: no `--data-dir`, no `--config`, under a private home.
fn in_home(home: &std::path::Path) -> Command {
    let mut c = Command::new(gpunode_bin());
    c.env("HOME", home)
        .env_remove("GPUNODE_DATA_DIR")
        .env_remove("GPUNODE_CONFIG")
        .env_remove("XDG_DATA_HOME")
        .env_remove("XDG_CONFIG_HOME");
    c
}

#[test]
fn the_dashboard_of_a_node_in_the_default_data_dir_under_a_private_home() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("tmp");
    let home = tmp.path().join("home");
    std::fs::create_dir(&home).expect("home");
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    // The default config file, as a user would write it.
    let config_dir = home.join(".config/gpunode");
    std::fs::create_dir_all(&config_dir).expect("config dir");
    std::fs::write(config_dir.join("config.toml"), CONFIG).expect("config");
    let log = std::fs::File::create(tmp.path().join("serve.log")).expect("log");
    let mut serve = gpunode_e2e::KillOnDrop(
        in_home(&home)
            .args([
                "serve",
                "--no-mdns",
                "--listen",
                "/ip4/127.0.0.1/udp/0/quic-v1",
            ])
            .args(["--simulate-gpus", "1xT4-16GB"])
            .stderr(log)
            .spawn()
            .expect("serve"),
    );
    let url = link_once_served(|| {
        in_home(&home)
            .args(["dashboard", "--no-open"])
            .output()
            .expect("dashboard")
    });
    let rest = url.strip_prefix("http://").expect("http link");
    let (addr, token) = rest.split_once("/?token=").expect("token in the link");
    let (code, head, _) = get(addr, &format!("/?token={token}"), "");
    assert_eq!(code, 303, "{head}");
    let cookie = format!("Cookie: gpunode_dashboard={token}\r\n");
    let (code, _, body) = get(addr, "/v1/status", &cookie);
    assert_eq!(code, 200, "{body}");
    wait_for_gpu_plot(addr, &cookie);
    // Stopped as systemd or a user would stop it: the history is kept in the default
    // data dir, which only its owner can enter.
    let term = Command::new("kill")
        .args(["-TERM", &serve.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(term.success());
    assert!(serve.0.wait().expect("exit").success());
    let data_dir = home.join(".local/share/gpunode");
    let mode = std::fs::metadata(&data_dir)
        .expect("data dir")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "{}", data_dir.display());
    assert!(data_dir.join("gpu-history.bin").is_file());
    assert!(data_dir.join("identity.key").is_file());
}

#[test]
fn the_page_shows_providers_plots_a_waiting_job_and_receipts_and_updates_live() {
    let driver = workspace_file("tests/dashboard/e2e.mjs");
    assert!(
        workspace_file("tests/dashboard/node_modules/puppeteer-core").exists(),
        "tests/dashboard has no node_modules: run scripts/install-deps.sh"
    );
    let tmp = tempfile::tempdir().expect("tmp");
    let listen = format!(
        "/ip4/127.0.0.1/udp/{}/quic-v1",
        gpunode_e2e::free_udp_port()
    );
    let provider = start(
        &tmp.path().join("p"),
        &["--listen", &listen, "--simulate-gpus", "1xA100-80GB"],
    );
    let requester = start(
        &tmp.path().join("r"),
        &[
            "--bootstrap",
            &provider.addr,
            "--simulate-gpus",
            "1xT4-16GB",
        ],
    );
    let hello = workspace_file("examples/wat/hello.wat");
    let hello = hello.to_str().expect("utf8");
    let out_dir = tmp.path().join("out");
    let run = |extra: &[&str]| {
        let mut args = vec!["run", hello, "--peer", &provider.peer_id, "--output"];
        let out = out_dir.join(format!("{}", rand_suffix()));
        let out = out.to_str().expect("utf8").to_string();
        args.push(&out);
        args.extend_from_slice(extra);
        gpunode(&requester.data_dir, &args)
    };
    // One job that ends: a receipt on both sides.
    let out = run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));

    // The provider's only GPU is held; a job that waits for it.
    let out = gpunode(
        &requester.data_dir,
        &[
            "lease",
            "request",
            "--peer",
            &provider.peer_id,
            "--gpus",
            "1",
            "--duration",
            "10m",
            "--json",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let lease: Value = serde_json::from_str(&stdout(&out)).expect("lease JSON");
    let lease_id = lease["lease_id"].as_str().expect("id").to_string();
    let mut waiting = Command::new(gpunode_bin())
        .arg("--data-dir")
        .arg(&requester.data_dir)
        .args([
            "run",
            hello,
            "--peer",
            &provider.peer_id,
            "--gpus",
            "1",
            "--wait",
            "--output",
        ])
        .arg(out_dir.join("waited"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("waiting run");

    let url = dashboard_url(&requester.data_dir);
    let mut browser = Command::new("node");
    browser.arg(&driver).arg(&url).arg(&provider.peer_id);
    if let Ok(dir) = std::env::var("GPUNODE_SCREENSHOTS") {
        let dir = workspace_file(&dir);
        std::fs::create_dir_all(&dir).expect("screenshot dir");
        browser.arg("--screenshots").arg(dir);
    }
    let mut browser = browser
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("node runs (scripts/install-deps.sh installs it)");
    let mut lines = BufReader::new(browser.stdout.take().expect("stdout")).lines();
    let ready = lines.next().and_then(Result::ok).unwrap_or_default();
    if ready != "READY" {
        let _ = browser.kill();
        let mut err = String::new();
        if let Some(mut e) = browser.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        let _ = waiting.kill();
        panic!("the page failed its checks: {ready} {err}");
    }
    // Free the GPU: the waiting job starts, and the page must hear of it live.
    let out = gpunode(&requester.data_dir, &["lease", "cancel", &lease_id[..8]]);
    assert!(out.status.success(), "{}", stderr(&out));
    browser
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("tell the page");
    let result = lines.next().and_then(Result::ok).unwrap_or_default();
    let status = browser.wait().expect("browser exits");
    let mut err = String::new();
    if let Some(mut e) = browser.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let waited = waiting.wait().expect("the waiting run ends");
    assert!(
        status.success(),
        "the page failed its checks: {result} {err}"
    );
    let measured: Value = serde_json::from_str(&result).expect("the driver's JSON line");
    assert!(
        measured["plot_samples"].as_u64().unwrap_or(0) >= 2,
        "{measured}"
    );
    assert!(
        measured["receipts"].as_u64().unwrap_or(0) >= 1,
        "{measured}"
    );
    assert!(
        waited.success(),
        "the waiting job ran once the GPU was free"
    );
    eprintln!("dashboard e2e: {measured}");
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}
