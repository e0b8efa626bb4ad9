;; Sleeps for the number of milliseconds given as its first argument (WASI poll_oneoff
;; on the monotonic clock), prints "slept" and exits 0. No argument: 0 ms.
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_get" (func $args_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll_oneoff (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "slept\n")
  (func (export "_start")
    (local $argc i32) (local $p i32) (local $c i32) (local $ms i64)
    ;; argc at 16, buffer size at 20; argv pointers at 1024, strings at 2048.
    (drop (call $args_sizes_get (i32.const 16) (i32.const 20)))
    (local.set $argc (i32.load (i32.const 16)))
    (if (i32.gt_u (local.get $argc) (i32.const 1))
      (then
        (drop (call $args_get (i32.const 1024) (i32.const 2048)))
        (local.set $p (i32.load (i32.const 1028)))
        (block $done
          (loop $digits
            (local.set $c (i32.load8_u (local.get $p)))
            (br_if $done (i32.lt_u (local.get $c) (i32.const 48)))
            (br_if $done (i32.gt_u (local.get $c) (i32.const 57)))
            (local.set $ms (i64.add (i64.mul (local.get $ms) (i64.const 10))
                                    (i64.extend_i32_u (i32.sub (local.get $c) (i32.const 48)))))
            (local.set $p (i32.add (local.get $p) (i32.const 1)))
            (br $digits)))))
    ;; One clock subscription at 256 (48 bytes): userdata 0, tag 0 (clock),
    ;; clock id 1 (monotonic) at +16, timeout ns at +24, precision at +32, flags 0 at +40.
    (i64.store (i32.const 256) (i64.const 0))
    (i32.store8 (i32.const 264) (i32.const 0))
    (i32.store (i32.const 272) (i32.const 1))
    (i64.store (i32.const 280) (i64.mul (local.get $ms) (i64.const 1000000)))
    (i64.store (i32.const 288) (i64.const 0))
    (i32.store16 (i32.const 296) (i32.const 0))
    (drop (call $poll_oneoff (i32.const 256) (i32.const 512) (i32.const 1) (i32.const 600)))
    (i32.store (i32.const 0) (i32.const 100))
    (i32.store (i32.const 4) (i32.const 6))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))
