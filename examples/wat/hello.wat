;; A gpunode task in WebAssembly text: no toolchain needed.
;;
;;   gpunode run examples/wat/hello.wat
;;
;; Prints a greeting to stdout and writes the same line to /output/hello.txt.
;; gpunode preopens /input as fd 3 and /output as fd 4.
(module
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  ;; the greeting, 29 bytes
  (data (i32.const 64) "hello from a gpunode sandbox\n")
  ;; the file name, 9 bytes
  (data (i32.const 128) "hello.txt")
  (func (export "_start")
    (local $fd i32)
    ;; iovec at 0: { ptr = 64, len = 29 }
    (i32.store (i32.const 0) (i32.const 64))
    (i32.store (i32.const 4) (i32.const 29))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 16)))
    ;; open /output/hello.txt: O_CREAT|O_TRUNC = 9, rights fd_write (bit 6)
    (if (i32.ne
          (call $path_open (i32.const 4) (i32.const 0) (i32.const 128) (i32.const 9)
                (i32.const 9) (i64.const 64) (i64.const 0) (i32.const 0) (i32.const 32))
          (i32.const 0))
      (then (call $proc_exit (i32.const 3))))
    (local.set $fd (i32.load (i32.const 32)))
    (drop (call $fd_write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 16)))
    (call $proc_exit (i32.const 0))))
