use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpunode_sandbox::wasm::CacheSource;
use gpunode_sandbox::{
    CancelToken, Isolation, Limits, Outcome, RunSpec, SandboxError, WasmExecutor,
};

/// WASI imports and a tiny runtime shared by the guests below. Memory layout: 0..64 scratch
/// (iovec at 0, result words at 16 and 20), strings from 100.
const PRELUDE: &str = r#"
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (memory (export "memory") 1)
  ;; write(fd, ptr, len) -> errno
  (func $write (param $fd i32) (param $ptr i32) (param $len i32) (result i32)
    (i32.store (i32.const 0) (local.get $ptr))
    (i32.store (i32.const 4) (local.get $len))
    (call $fd_write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 16)))
  ;; open(dirfd, path ptr, path len, create?) -> fd or -errno
  (func $open (param $dir i32) (param $p i32) (param $n i32) (param $create i32) (result i32)
    (local $err i32)
    (local.set $err (call $path_open (local.get $dir) (i32.const 0) (local.get $p) (local.get $n)
      (select (i32.const 9) (i32.const 0) (local.get $create))
      (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 20)))
    (if (result i32) (local.get $err)
      (then (i32.sub (i32.const 0) (local.get $err)))
      (else (i32.load (i32.const 20)))))
"#;

fn guest(body: &str) -> Vec<u8> {
    format!("(module {PRELUDE} {body})").into_bytes()
}

struct Run {
    outcome: Outcome,
    stdout: Vec<u8>,
    output_dir: tempfile::TempDir,
}

fn executor() -> (WasmExecutor, tempfile::TempDir) {
    let cache = tempfile::tempdir().expect("tmp");
    let isolation = if IN_WORKER_PROCESS {
        Isolation::Process(env!("CARGO_BIN_EXE_gpunode-wasm-worker").into())
    } else {
        Isolation::Thread
    };
    (
        WasmExecutor::with_isolation(cache.path(), isolation).expect("executor"),
        cache,
    )
}

fn run_with(
    exec: &WasmExecutor,
    wasm: &[u8],
    limits: Limits,
    input: Option<&std::path::Path>,
    cancel: CancelToken,
) -> Run {
    let task = exec.compile(wasm, limits.fuel.is_some()).expect("compiles");
    let out = tempfile::tempdir().expect("tmp");
    let stdout = Arc::new(Mutex::new(Vec::new()));
    let sink = stdout.clone();
    let outcome = exec
        .run(
            &task,
            RunSpec {
                args: vec!["a1".into()],
                env: vec![("K".into(), "V".into())],
                input_dir: input.map(|p| p.to_path_buf()),
                output_dir: out.path().to_path_buf(),
                limits,
                stdout: Box::new(move |b| sink.lock().expect("lock").extend_from_slice(b)),
                stderr: Box::new(|_| {}),
                cancel,
            },
        )
        .expect("runs");
    let stdout = stdout.lock().expect("lock").clone();
    Run {
        outcome,
        stdout,
        output_dir: out,
    }
}

fn run(wasm: &[u8], limits: Limits) -> Run {
    let (exec, _cache) = executor();
    run_with(&exec, wasm, limits, None, CancelToken::new())
}

fn short() -> Limits {
    Limits {
        wall_time: Duration::from_secs(5),
        ..Limits::default()
    }
}

#[test]
fn exit_code_and_stdout_pass_through() {
    let wasm = guest(
        r#"
      (data (i32.const 100) "hello from wasm\n")
      (func (export "_start")
        (drop (call $write (i32.const 1) (i32.const 100) (i32.const 16)))
        (call $proc_exit (i32.const 7)))"#,
    );
    let r = run(&wasm, short());
    assert_eq!(r.outcome, Outcome::Exited(7));
    assert_eq!(r.stdout, b"hello from wasm\n");
    let wasm = guest(r#"(func (export "_start"))"#);
    assert_eq!(run(&wasm, short()).outcome, Outcome::Exited(0));
}

#[test]
fn infinite_loop_hits_the_wall_clock_deadline() {
    let wasm = guest(r#"(func (export "_start") (loop $l (br $l)))"#);
    let r = run(
        &wasm,
        Limits {
            wall_time: Duration::from_millis(300),
            ..Limits::default()
        },
    );
    assert_eq!(r.outcome, Outcome::TimedOut);
}

#[test]
fn infinite_loop_runs_out_of_fuel() {
    let wasm = guest(r#"(func (export "_start") (loop $l (br $l)))"#);
    let r = run(
        &wasm,
        Limits {
            fuel: Some(1_000_000),
            ..short()
        },
    );
    assert_eq!(r.outcome, Outcome::OutOfFuel);
}

#[test]
fn memory_grow_bomb_is_out_of_memory() {
    let wasm = guest(
        r#"(func (export "_start")
        (loop $l (drop (memory.grow (i32.const 16))) (br $l)))"#,
    );
    let r = run(
        &wasm,
        Limits {
            memory_bytes: 8 << 20,
            ..short()
        },
    );
    assert_eq!(r.outcome, Outcome::OutOfMemory);
}

#[test]
fn trap_is_reported() {
    let wasm = guest(r#"(func (export "_start") unreachable)"#);
    assert!(matches!(run(&wasm, short()).outcome, Outcome::Trapped(_)));
}

#[test]
fn stdout_flood_is_output_too_large() {
    let wasm = guest(
        r#"
      (data (i32.const 100) "flood flood flood flood flood flood flood flood flood flood\n")
      (func (export "_start")
        (loop $l (drop (call $write (i32.const 1) (i32.const 100) (i32.const 60))) (br $l)))"#,
    );
    let r = run(
        &wasm,
        Limits {
            stdout_bytes: 4096,
            ..short()
        },
    );
    assert_eq!(r.outcome, Outcome::OutputTooLarge("stdout".into()));
    assert!(r.stdout.len() <= 4096);
}

const WRITE_FILE: &str = r#"
  (data (i32.const 100) "result.txt")
  (data (i32.const 200) "forty-two\n")
  (func (export "_start")
    (local $fd i32)
    ;; /output is fd 3 when there is no /input
    (local.set $fd (call $open (i32.const 3) (i32.const 100) (i32.const 10) (i32.const 1)))
    (if (i32.lt_s (local.get $fd) (i32.const 0)) (then (call $proc_exit (i32.const 1))))
    (drop (call $write (local.get $fd) (i32.const 200) (i32.const 10))))"#;

#[test]
fn files_written_to_output_come_back() {
    let r = run(&guest(WRITE_FILE), short());
    assert_eq!(r.outcome, Outcome::Exited(0));
    let text = std::fs::read_to_string(r.output_dir.path().join("result.txt")).expect("written");
    assert_eq!(text, "forty-two\n");
}

#[test]
fn escaping_output_or_reading_host_paths_is_refused() {
    // "../escape.txt" relative to /output, and "/etc/passwd" and "../../etc/passwd".
    for path in ["../escape.txt", "/etc/passwd", "../../../../etc/passwd"] {
        let wasm = guest(&format!(
            r#"
          (data (i32.const 100) "{path}")
          (func (export "_start")
            (if (i32.ge_s (call $open (i32.const 3) (i32.const 100) (i32.const {len}) (i32.const 1)) (i32.const 0))
              (then (call $proc_exit (i32.const 0))))
            (call $proc_exit (i32.const 1)))"#,
            len = path.len()
        ));
        let r = run(&wasm, short());
        assert_eq!(r.outcome, Outcome::Exited(1), "{path} was opened");
        let parent = r.output_dir.path().parent().expect("parent");
        assert!(!parent.join("escape.txt").exists());
    }
}

#[test]
fn input_is_read_only() {
    let input = tempfile::tempdir().expect("tmp");
    std::fs::write(input.path().join("data.txt"), "in").expect("write");
    let (exec, _c) = executor();
    // With /input present it is fd 3; creating a file there must fail.
    let wasm = guest(
        r#"
      (data (i32.const 100) "new.txt")
      (func (export "_start")
        (if (i32.ge_s (call $open (i32.const 3) (i32.const 100) (i32.const 7) (i32.const 1)) (i32.const 0))
          (then (call $proc_exit (i32.const 0))))
        (call $proc_exit (i32.const 1)))"#,
    );
    let r = run_with(
        &exec,
        &wasm,
        short(),
        Some(input.path()),
        CancelToken::new(),
    );
    assert_eq!(r.outcome, Outcome::Exited(1));
    assert!(!input.path().join("new.txt").exists());
}

#[test]
fn output_dir_size_and_file_count_are_capped() {
    // Writes one 64 KiB chunk per iteration into result.txt, forever.
    let big = guest(
        r#"
      (func (export "_start")
        (local $fd i32)
        (i32.store (i32.const 100) (i32.const 0x74736574)) ;; "test"
        (local.set $fd (call $open (i32.const 3) (i32.const 100) (i32.const 4) (i32.const 1)))
        (loop $l (drop (call $write (local.get $fd) (i32.const 1024) (i32.const 60000))) (br $l)))"#,
    );
    let r = run(
        &big,
        Limits {
            output_bytes: 1 << 20,
            ..short()
        },
    );
    assert!(
        matches!(&r.outcome, Outcome::OutputTooLarge(w) if w.contains("bytes")),
        "{:?}",
        r.outcome
    );
    // Creates files f0..f9 (names built in memory); the cap is 5.
    let many = guest(
        r#"
      (func (export "_start")
        (local $i i32)
        (i32.store8 (i32.const 100) (i32.const 102)) ;; 'f'
        (loop $l
          (i32.store8 (i32.const 101) (i32.add (i32.const 48) (local.get $i)))
          (drop (call $open (i32.const 3) (i32.const 100) (i32.const 2) (i32.const 1)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $l (i32.lt_u (local.get $i) (i32.const 10)))))"#,
    );
    let r = run(
        &many,
        Limits {
            output_files: 5,
            ..short()
        },
    );
    assert!(
        matches!(&r.outcome, Outcome::OutputTooLarge(w) if w.contains("files")),
        "{:?}",
        r.outcome
    );
}

#[test]
fn cancel_stops_a_running_guest() {
    let (exec, _c) = executor();
    let wasm = guest(r#"(func (export "_start") (loop $l (br $l)))"#);
    let cancel = CancelToken::new();
    let c = cancel.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        c.cancel();
    });
    let r = run_with(&exec, &wasm, short(), None, cancel);
    t.join().expect("join");
    assert_eq!(r.outcome, Outcome::Cancelled);
}

#[test]
fn invalid_modules_are_rejected_before_running() {
    let (exec, _c) = executor();
    match exec.compile(b"\0asm garbage", false) {
        Err(SandboxError::InvalidModule(_)) => {}
        other => panic!("garbage accepted: {other:?}"),
    }
    let unknown = br#"(module (import "env" "launch_missiles" (func)) (func (export "_start")))"#;
    match exec.compile(unknown, false) {
        Err(SandboxError::InvalidModule(m)) => assert!(m.contains("env::launch_missiles"), "{m}"),
        other => panic!("unknown import accepted: {other:?}"),
    }
    let fake_wasi = br#"(module (import "wasi_snapshot_preview1" "no_such_call" (func)) (func (export "_start")))"#;
    assert!(matches!(
        exec.compile(fake_wasi, false),
        Err(SandboxError::InvalidModule(_))
    ));
    let no_start = br#"(module (func (export "main")))"#;
    match exec.compile(no_start, false) {
        Err(SandboxError::InvalidModule(m)) => assert!(m.contains("_start"), "{m}"),
        other => panic!("module without _start accepted: {other:?}"),
    }
}

#[test]
fn compiled_modules_are_cached_by_content_hash() {
    let cache = tempfile::tempdir().expect("tmp");
    let wasm = guest(WRITE_FILE);
    {
        let exec = WasmExecutor::new(cache.path()).expect("executor");
        assert_eq!(
            exec.compile(&wasm, false).expect("compile").source,
            CacheSource::Compiled
        );
        assert_eq!(
            exec.compile(&wasm, false).expect("compile").source,
            CacheSource::Memory
        );
    }
    // A new executor (a restarted node) loads its own artifact from disk.
    let exec = WasmExecutor::new(cache.path()).expect("executor");
    let task = exec.compile(&wasm, false).expect("compile");
    assert_eq!(task.source, CacheSource::Disk);
    assert_eq!(task.hash, blake3::hash(&wasm).to_hex().to_string());
    let r = run_with(&exec, &wasm, short(), None, CancelToken::new());
    assert_eq!(r.outcome, Outcome::Exited(0));
}

#[test]
fn other_jobs_keep_running_beside_a_hostile_one() {
    let (exec, _c) = executor();
    let exec = Arc::new(exec);
    let spin = guest(r#"(func (export "_start") (loop $l (br $l)))"#);
    let e2 = exec.clone();
    // The spinner's deadline is far off (a loaded machine may take seconds to compile and
    // start the honest job); it is cancelled once the honest job is done.
    let stop_hog = CancelToken::new();
    let stop = stop_hog.clone();
    let hog = std::thread::spawn(move || {
        run_with(
            &e2,
            &spin,
            Limits {
                wall_time: Duration::from_secs(60),
                ..Limits::default()
            },
            None,
            stop,
        )
    });
    std::thread::sleep(Duration::from_millis(100));
    let r = run_with(&exec, &guest(WRITE_FILE), short(), None, CancelToken::new());
    assert_eq!(r.outcome, Outcome::Exited(0));
    // The other job finished while the hostile one was still spinning.
    assert!(
        !hog.is_finished(),
        "the hostile job ended before the honest one"
    );
    stop_hog.cancel();
    assert_eq!(hog.join().expect("join").outcome, Outcome::Cancelled);
}
