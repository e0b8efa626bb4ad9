;; Prints "started", spins 2^31 iterations (a second or two), prints "done" and exits 7.
;; Given any argument at all, it spins forever.
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "started\n")
  (data (i32.const 120) "done\n")
  (func $print (param $ptr i32) (param $len i32)
    (i32.store (i32.const 0) (local.get $ptr))
    (i32.store (i32.const 4) (local.get $len))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))))
  (func (export "_start")
    (local $i i32) (local $forever i32)
    (drop (call $args_sizes_get (i32.const 16) (i32.const 20)))
    (local.set $forever (i32.gt_u (i32.load (i32.const 16)) (i32.const 1)))
    (call $print (i32.const 100) (i32.const 8))
    (loop $spin
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $spin (i32.or (local.get $forever) (i32.lt_u (local.get $i) (i32.const 0x7fffffff)))))
    (call $print (i32.const 120) (i32.const 5))
    (call $proc_exit (i32.const 7))))
