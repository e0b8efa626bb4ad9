//! futures-timer, which runs libp2p's timeouts (every stream's upgrade, every request's
//! deadline, the idle connection timer), is vendored so that its thread is woken only
//! when a timer needs it (`vendor/README.md`). These tests attack that change: a timer
//! set while the thread sleeps towards a later one, timers created and dropped by the
//! thousand while it sleeps, and many threads setting timers at once, each of which
//! would hang (and fail on the deadline below) if a wake-up were lost. The tests share
//! the one helper thread, so they run one at a time: another test's timers would wake it
//! and hide a lost wake-up.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::join_all;
use futures::task::{waker, ArcWake};
use futures_timer::Delay;

/// Far longer than any timer below: reaching it means a timer did not fire.
const HANG: Duration = Duration::from_secs(20);

/// Held by each test: the helper thread is the process's.
fn alone() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

async fn fires(delay: Delay) {
    tokio::time::timeout(HANG, delay)
        .await
        .expect("the timer did not fire: its thread was not woken");
}

/// Runs `test` alone, on a runtime of its own (for its deadlines).
fn run_alone(test: impl Future<Output = ()>) {
    let _alone = alone();
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
        .block_on(test);
}

#[test]
fn a_timer_due_before_the_sleeping_threads_next_look_wakes_it() {
    run_alone(async {
        // The thread takes the far timer and sleeps until it is due.
        let _far = Delay::new(Duration::from_secs(3600));
        tokio::time::sleep(Duration::from_millis(50)).await;
        fires(Delay::new(Duration::from_millis(10))).await;
        // Once more, now that the thread has slept towards the far timer again.
        tokio::time::sleep(Duration::from_millis(50)).await;
        fires(Delay::new(Duration::from_millis(1))).await;
    });
}

#[test]
fn timers_dropped_by_the_thousand_while_the_thread_sleeps_leave_it_working() {
    run_alone(async {
        let _far = Delay::new(Duration::from_secs(3600));
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Removals and later timers do not wake the thread until many wait.
        for _ in 0..5_000 {
            drop(Delay::new(Duration::from_secs(600)));
        }
        let mut later: Vec<Delay> = (0..3_000)
            .map(|_| Delay::new(Duration::from_secs(1200)))
            .collect();
        fires(Delay::new(Duration::from_millis(5))).await;
        // A reset to sooner than the thread's next look wakes it too.
        let mut reset = later.pop().expect("timers were made");
        reset.reset(Duration::from_millis(5));
        fires(reset).await;
        drop(later);
        fires(Delay::new(Duration::from_millis(5))).await;
    });
}

#[test]
fn timers_set_from_many_threads_at_once_all_fire() {
    let _alone = alone();
    const THREADS: u64 = 4;
    let (done, finished) = std::sync::mpsc::channel();
    for t in 0..THREADS {
        let done = done.clone();
        // Detached: a thread stuck on a timer that never fires must not hang the test.
        std::thread::spawn(move || {
            futures::executor::block_on(async move {
                for round in 0..200u64 {
                    // Timers due at once, soon and later, one dropped early.
                    let delays = (0..8u64).map(|i| {
                        Delay::new(Duration::from_micros((round * 7 + i * 131 + t) % 3_000))
                    });
                    let _dropped = Delay::new(Duration::from_millis(1));
                    join_all(delays).await;
                }
            });
            let _ = done.send(t);
        });
    }
    for _ in 0..THREADS {
        finished
            .recv_timeout(HANG)
            .expect("a timer set from one of the threads did not fire");
    }
}

/// A waker that does nothing: the test only counts who holds it.
struct Idle;

impl ArcWake for Idle {
    fn wake_by_ref(_: &Arc<Self>) {}
}

#[test]
fn a_dropped_timer_is_let_go_once_many_updates_wait() {
    let _alone = alone();
    // The thread sleeps towards a far timer; the dropped timer and the ones after it
    // are due later still, so none wakes it, and only the bound on waiting updates
    // makes it take the dropped timer (and the waker it holds) before the far one.
    // A timer that fires first makes the thread take what earlier tests left waiting.
    futures::executor::block_on(Delay::new(Duration::from_millis(1)));
    let _far = Delay::new(Duration::from_secs(600));
    std::thread::sleep(Duration::from_millis(50));
    let idle = Arc::new(Idle);
    let mut dropped = Delay::new(Duration::from_secs(3600));
    let w = waker(idle.clone());
    assert_eq!(
        Pin::new(&mut dropped).poll(&mut Context::from_waker(&w)),
        Poll::Pending
    );
    drop(w);
    drop(dropped);
    // Time for a wake-up that should not come (nothing to wait on when it does not):
    // a thread woken by the drop would have let the waker go by now.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        Arc::strong_count(&idle),
        2,
        "the dropped timer still holds its waker"
    );
    for _ in 0..1_100 {
        drop(Delay::new(Duration::from_secs(7200)));
    }
    let deadline = Instant::now() + HANG;
    while Arc::strong_count(&idle) > 1 {
        assert!(
            Instant::now() < deadline,
            "1,100 dropped timers did not make the thread let go of them"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
