//! Worker processes started ahead of need (`WasmExecutor::keep_workers_ready`): tasks
//! run on them with every limit still enforced, each task gets a process of its own that
//! is gone after it, the pool refills (also while a long task runs), a ready worker killed from outside is skipped,
//! and stopping the pool leaves no process behind.
//!
//! One test in its own binary: it counts this process's worker children in `/proc`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpunode_sandbox::wasm::worker::WORKER_ARG;
use gpunode_sandbox::{CancelToken, Isolation, Limits, Outcome, RunSpec, WasmExecutor};

const HELLO: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "hello\n")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 100))
    (i32.store (i32.const 4) (i32.const 6))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 16)))))"#;

const SPIN: &str = r#"(module (func (export "_start") (loop $l (br $l))))"#;

/// Live worker processes whose parent is this test (zombies not counted).
fn worker_children() -> Vec<u32> {
    let me = std::process::id().to_string();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some(rest) = stat.rsplit_once(") ").map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split(' ').collect();
        if fields.first() == Some(&"Z") || fields.get(1) != Some(&me.as_str()) {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(WORKER_ARG) {
            pids.push(pid);
        }
    }
    pids.sort();
    pids
}

/// Whether process `pid` has exited and can be reaped: gone, or a zombie whose other
/// threads have exited too (a killed multi-threaded process shows its main thread as a
/// zombie while the others are still exiting, and cannot be waited for until then).
fn dead(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    let zombie = stat
        .rsplit_once(") ")
        .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X'));
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
    zombie && threads <= 1
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run(exec: &WasmExecutor, wat: &str, limits: Limits) -> (Outcome, Vec<u8>) {
    run_until(exec, wat, limits, CancelToken::new())
}

/// Like [`run`], stopped when `cancel` is.
fn run_until(
    exec: &WasmExecutor,
    wat: &str,
    limits: Limits,
    cancel: CancelToken,
) -> (Outcome, Vec<u8>) {
    let task = exec
        .compile(wat.as_bytes(), limits.fuel.is_some())
        .expect("compiles");
    let out = tempfile::tempdir().expect("tmp");
    let stdout = Arc::new(Mutex::new(Vec::new()));
    let sink = stdout.clone();
    let outcome = exec
        .run(
            &task,
            RunSpec {
                args: Vec::new(),
                env: Vec::new(),
                input_dir: None,
                output_dir: out.path().to_path_buf(),
                limits,
                stdout: Box::new(move |b| sink.lock().expect("lock").extend_from_slice(b)),
                stderr: Box::new(|_| {}),
                cancel,
            },
        )
        .expect("runs");
    let stdout = stdout.lock().expect("lock").clone();
    (outcome, stdout)
}

fn limits(wall_ms: u64, fuel: Option<u64>) -> Limits {
    Limits {
        wall_time: Duration::from_millis(wall_ms),
        fuel,
        ..Limits::default()
    }
}

#[test]
fn ready_workers_run_one_task_each_under_every_limit_and_leave_nothing_behind() {
    let cache = tempfile::tempdir().expect("tmp");
    let exec = WasmExecutor::with_isolation(
        cache.path(),
        Isolation::Process(env!("CARGO_BIN_EXE_gpunode-wasm-worker").into()),
    )
    .expect("executor");
    assert!(worker_children().is_empty());
    exec.keep_workers_ready(2);
    wait_until("two workers are ready", || {
        exec.workers_ready() == 2 && worker_children().len() == 2
    });
    let before = worker_children();

    // A task runs on a ready worker, which is gone after it; the pool refills.
    let (outcome, stdout) = run(&exec, HELLO, limits(10_000, None));
    assert_eq!(outcome, Outcome::Exited(0));
    assert_eq!(stdout, b"hello\n");
    wait_until("the pool refilled and the used worker is gone", || {
        let now = worker_children();
        now.len() == 2 && now.iter().filter(|p| before.contains(p)).count() == 1
    });

    // The limits still hold on ready workers: the deadline kills, fuel runs out.
    assert_eq!(run(&exec, SPIN, limits(300, None)).0, Outcome::TimedOut);
    assert_eq!(
        run(&exec, SPIN, limits(10_000, Some(1_000_000))).0,
        Outcome::OutOfFuel
    );

    // A long task does not hold its replacement back for long: the pool refills while
    // it runs.
    wait_until("two workers are ready before the long task", || {
        exec.workers_ready() == 2
    });
    let cancel = CancelToken::new();
    let long = std::thread::scope(|scope| {
        let running =
            scope.spawn(|| run_until(&exec, SPIN, limits(120_000, None), cancel.clone()).0);
        // Two ready and the one running the task.
        wait_until("the pool refilled while the long task runs", || {
            exec.workers_ready() == 2 && worker_children().len() == 3
        });
        assert!(!running.is_finished(), "the long task ended early");
        cancel.cancel();
        running.join().expect("joins")
    });
    assert_eq!(long, Outcome::Cancelled);

    // A ready worker killed from outside is not handed a task.
    wait_until("two workers are ready again", || {
        exec.workers_ready() == 2 && worker_children().len() == 2
    });
    let killed = worker_children();
    for pid in &killed {
        let status = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }
    // A kill lands asynchronously: once they are dead (zombies, not yet reaped), a task
    // must not be handed one of them.
    wait_until("the killed workers are dead", || {
        killed.iter().all(|p| dead(*p))
    });
    let (outcome, stdout) = run(&exec, HELLO, limits(10_000, None));
    assert_eq!(outcome, Outcome::Exited(0));
    assert_eq!(stdout, b"hello\n");

    // No ready workers wanted: none is left running.
    exec.keep_workers_ready(0);
    wait_until("no worker is left", || worker_children().is_empty());
    exec.keep_workers_ready(1);
    wait_until("one worker is ready", || worker_children().len() == 1);
    drop(exec);
    wait_until("dropping the executor stops its workers", || {
        worker_children().is_empty()
    });
}
