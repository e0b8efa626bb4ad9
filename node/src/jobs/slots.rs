//! CPU slots of a provider: when jobs wait for room, they are served in the same order as
//! lease requests (the requester's [`Rank`]: team role, then what it has given back, then
//! reputation), and equal ranks go in arrival order.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};

use gpunode_sched::Rank;
use tokio::sync::oneshot;

/// A pool of slots (one per offered CPU core).
#[derive(Debug)]
pub struct Slots {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    free: u32,
    waiting: BinaryHeap<Waiter>,
    next_seq: u64,
}

#[derive(Debug)]
struct Waiter {
    priority: Rank,
    seq: u64,
    need: u32,
    grant: oneshot::Sender<()>,
}

impl PartialEq for Waiter {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Waiter {}
impl PartialOrd for Waiter {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiter {
    /// Higher priority first, then earlier arrival.
    fn cmp(&self, other: &Self) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// Slots held by a job; given back when dropped.
#[derive(Debug)]
pub struct SlotPermit {
    slots: Arc<Slots>,
    count: u32,
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        self.slots.release(self.count);
    }
}

/// A wait that was granted slots after its waiter stopped waiting gives them back.
struct Pending {
    slots: Arc<Slots>,
    need: u32,
    rx: Option<oneshot::Receiver<()>>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            if rx.try_recv().is_ok() {
                self.slots.release(self.need);
            }
        }
    }
}

impl Slots {
    /// A pool of `total` slots.
    pub fn new(total: u32) -> Arc<Slots> {
        Arc::new(Slots {
            state: Mutex::new(State {
                free: total,
                waiting: BinaryHeap::new(),
                next_seq: 0,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for `need` slots; among waiters, higher `priority` is served first.
    pub async fn acquire(self: &Arc<Self>, need: u32, priority: Rank) -> SlotPermit {
        let rx = {
            let mut s = self.lock();
            if s.waiting.is_empty() && s.free >= need {
                s.free -= need;
                return SlotPermit {
                    slots: self.clone(),
                    count: need,
                };
            }
            let (grant, rx) = oneshot::channel();
            let seq = s.next_seq;
            s.next_seq += 1;
            s.waiting.push(Waiter {
                priority,
                seq,
                need,
                grant,
            });
            rx
        };
        let mut pending = Pending {
            slots: self.clone(),
            need,
            rx: Some(rx),
        };
        if let Some(rx) = pending.rx.as_mut() {
            // The sender lives in the queue until granted; it is never dropped unsent.
            let _ = rx.await;
        }
        pending.rx = None;
        SlotPermit {
            slots: self.clone(),
            count: need,
        }
    }

    fn release(&self, count: u32) {
        let mut s = self.lock();
        s.free += count;
        while s.waiting.peek().is_some_and(|w| w.need <= s.free) {
            let Some(w) = s.waiting.pop() else { break };
            s.free -= w.need;
            if w.grant.send(()).is_err() {
                // The waiter gave up before its turn.
                s.free += w.need;
            }
        }
    }

    /// Slots free now.
    pub fn free(&self) -> u32 {
        self.lock().free
    }

    /// Jobs waiting for slots now.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn queued(slots: &Slots, n: usize) {
        while slots.waiting() < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn waiters_are_served_by_standing_then_arrival() {
        let slots = Slots::new(1);
        let held = slots.acquire(1, (0, 0, 0)).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        let arrivals = [
            ("taker", (0, -50, 5)),
            ("first-equal", (0, 10, 5)),
            ("giver", (0, 500, 5)),
            ("second-equal", (0, 10, 5)),
        ];
        for (n, (name, priority)) in arrivals.into_iter().enumerate() {
            let (s, o) = (slots.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _p = s.acquire(1, priority).await;
                o.lock().expect("lock").push(name);
            }));
            // Each one queues before the next arrives.
            queued(&slots, n + 1).await;
        }
        drop(held);
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(
            *order.lock().expect("lock"),
            vec!["giver", "first-equal", "second-equal", "taker"]
        );
        assert_eq!(slots.free(), 1);
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_loses_nothing() {
        let slots = Slots::new(2);
        let held = slots.acquire(2, (0, 0, 0)).await;
        let s = slots.clone();
        let waiter = tokio::spawn(async move { s.acquire(2, (0, 0, 0)).await });
        queued(&slots, 1).await;
        waiter.abort();
        let _ = waiter.await;
        drop(held);
        assert_eq!(slots.free(), 2);
        let _again = slots.acquire(2, (0, 0, 0)).await;
        assert_eq!(slots.free(), 0);
    }
}
