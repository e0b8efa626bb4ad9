//! The seccomp filter every container job runs under (bubblewrap's `--seccomp FD`):
//! a classic BPF program that refuses, with `EPERM`, the system calls a job never needs
//! and that sandbox escapes and kernel exploits rely on: the kernel keyring, eBPF,
//! userfaultfd, perf events, io_uring, mounting, namespaces, ptrace, module loading,
//! kexec, clock and swap changes. Everything else is allowed.
//!
//! The program is built here, without a library: it is a few dozen instructions, and
//! each one is spelled out below. A process of another architecture (or the x32 ABI)
//! is killed, so that no syscall number can be smuggled past the list.

/// One classic BPF instruction (`struct sock_filter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Insn {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const BPF_JSET_K: u16 = 0x45; // BPF_JMP | BPF_JSET | BPF_K
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K

const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const EPERM: u32 = 1;
const ENOSYS: u32 = 38;
/// `clone` flag for a new user namespace.
const CLONE_NEWUSER: u32 = 0x1000_0000;

/// Offsets in `struct seccomp_data`.
const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;
/// The low 32 bits of the first argument (little-endian machines only, as both
/// architectures below are).
const OFFSET_ARG0_LOW: u32 = 16;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

/// x32 system calls on x86_64 carry this bit; they are refused as a whole.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// The system calls refused, by name (for docs and tests) and number.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub fn denied_syscalls() -> Vec<(&'static str, i64)> {
    let mut list = vec![
        ("keyctl", libc::SYS_keyctl),
        ("add_key", libc::SYS_add_key),
        ("request_key", libc::SYS_request_key),
        ("bpf", libc::SYS_bpf),
        ("userfaultfd", libc::SYS_userfaultfd),
        ("perf_event_open", libc::SYS_perf_event_open),
        ("io_uring_setup", libc::SYS_io_uring_setup),
        ("io_uring_enter", libc::SYS_io_uring_enter),
        ("io_uring_register", libc::SYS_io_uring_register),
        ("mount", libc::SYS_mount),
        ("umount2", libc::SYS_umount2),
        ("pivot_root", libc::SYS_pivot_root),
        ("move_mount", libc::SYS_move_mount),
        ("open_tree", libc::SYS_open_tree),
        ("fsopen", libc::SYS_fsopen),
        ("fsmount", libc::SYS_fsmount),
        ("fsconfig", libc::SYS_fsconfig),
        ("unshare", libc::SYS_unshare),
        ("setns", libc::SYS_setns),
        ("ptrace", libc::SYS_ptrace),
        ("process_vm_readv", libc::SYS_process_vm_readv),
        ("process_vm_writev", libc::SYS_process_vm_writev),
        ("kexec_load", libc::SYS_kexec_load),
        ("kexec_file_load", libc::SYS_kexec_file_load),
        ("init_module", libc::SYS_init_module),
        ("finit_module", libc::SYS_finit_module),
        ("delete_module", libc::SYS_delete_module),
        ("open_by_handle_at", libc::SYS_open_by_handle_at),
        ("name_to_handle_at", libc::SYS_name_to_handle_at),
        ("swapon", libc::SYS_swapon),
        ("swapoff", libc::SYS_swapoff),
        ("reboot", libc::SYS_reboot),
        ("acct", libc::SYS_acct),
        ("settimeofday", libc::SYS_settimeofday),
        ("clock_settime", libc::SYS_clock_settime),
        ("clock_adjtime", libc::SYS_clock_adjtime),
        ("adjtimex", libc::SYS_adjtimex),
        ("quotactl", libc::SYS_quotactl),
        ("lookup_dcookie", libc::SYS_lookup_dcookie),
    ];
    #[cfg(target_arch = "x86_64")]
    list.extend([("iopl", libc::SYS_iopl), ("ioperm", libc::SYS_ioperm)]);
    list
}

/// The filter as the kernel reads it (an array of `struct sock_filter`, native byte
/// order), for bubblewrap's `--seccomp FD`; `None` on architectures without a list.
pub fn program() -> Option<Vec<u8>> {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    {
        let insns = instructions(AUDIT_ARCH, &denied_syscalls());
        let mut bytes = Vec::with_capacity(insns.len() * 8);
        for i in insns {
            bytes.extend_from_slice(&i.code.to_ne_bytes());
            bytes.push(i.jt);
            bytes.push(i.jf);
            bytes.extend_from_slice(&i.k.to_ne_bytes());
        }
        Some(bytes)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        None
    }
}

/// The program: kill other architectures; refuse x32 calls, `clone` with a new user
/// namespace and the listed numbers with `EPERM`; answer `clone3` with `ENOSYS` (its
/// flags sit in memory a filter cannot read, and C libraries fall back to `clone`);
/// allow the rest.
fn instructions(arch: u32, denied: &[(&str, i64)]) -> Vec<Insn> {
    let mut a = Asm::default();
    a.op(BPF_LD_W_ABS, OFFSET_ARCH);
    a.jump(BPF_JEQ_K, arch, Some("arch_ok"), None);
    a.op(BPF_RET_K, SECCOMP_RET_KILL_PROCESS);
    a.label("arch_ok");
    a.op(BPF_LD_W_ABS, OFFSET_NR);
    a.jump(BPF_JGE_K, X32_SYSCALL_BIT, Some("deny"), None);
    a.jump(BPF_JEQ_K, libc::SYS_clone3 as u32, Some("enosys"), None);
    a.jump(BPF_JEQ_K, libc::SYS_clone as u32, Some("clone"), None);
    for (_, nr) in denied {
        a.jump(BPF_JEQ_K, *nr as u32, Some("deny"), None);
    }
    a.op(BPF_RET_K, SECCOMP_RET_ALLOW);
    a.label("clone");
    a.op(BPF_LD_W_ABS, OFFSET_ARG0_LOW);
    a.jump(BPF_JSET_K, CLONE_NEWUSER, Some("deny"), None);
    a.op(BPF_RET_K, SECCOMP_RET_ALLOW);
    a.label("enosys");
    a.op(BPF_RET_K, SECCOMP_RET_ERRNO | ENOSYS);
    a.label("deny");
    a.op(BPF_RET_K, SECCOMP_RET_ERRNO | EPERM);
    a.assemble()
}

/// A tiny assembler: forward jumps to named labels.
#[derive(Default)]
struct Asm {
    code: Vec<(Insn, Option<&'static str>, Option<&'static str>)>,
    labels: Vec<(&'static str, usize)>,
}

impl Asm {
    fn op(&mut self, code: u16, k: u32) {
        self.code.push((
            Insn {
                code,
                jt: 0,
                jf: 0,
                k,
            },
            None,
            None,
        ));
    }
    fn jump(&mut self, code: u16, k: u32, yes: Option<&'static str>, no: Option<&'static str>) {
        self.code.push((
            Insn {
                code,
                jt: 0,
                jf: 0,
                k,
            },
            yes,
            no,
        ));
    }
    fn label(&mut self, name: &'static str) {
        self.labels.push((name, self.code.len()));
    }
    fn assemble(self) -> Vec<Insn> {
        let at = |name: &str| {
            self.labels
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, i)| *i)
                .unwrap_or(usize::MAX)
        };
        let offset = |pc: usize, target: Option<&str>| -> u8 {
            // Jumps count from the next instruction and only go forward.
            target.map_or(0, |t| {
                u8::try_from(at(t).saturating_sub(pc + 1)).unwrap_or(u8::MAX)
            })
        };
        self.code
            .iter()
            .enumerate()
            .map(|(pc, (insn, yes, no))| Insn {
                jt: offset(pc, *yes),
                jf: offset(pc, *no),
                ..*insn
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the program as the kernel would, for one call.
    fn run(p: &[Insn], arch: u32, nr: u32) -> u32 {
        run_with(p, arch, nr, 0)
    }

    fn run_with(p: &[Insn], arch: u32, nr: u32, arg0: u32) -> u32 {
        let mut acc = 0u32;
        let mut pc = 0usize;
        loop {
            let i = p[pc];
            match i.code {
                BPF_LD_W_ABS => {
                    acc = match i.k {
                        OFFSET_ARCH => arch,
                        OFFSET_NR => nr,
                        OFFSET_ARG0_LOW => arg0,
                        other => panic!("load of offset {other}"),
                    }
                }
                BPF_JSET_K => {
                    pc += if acc & i.k != 0 { i.jt } else { i.jf } as usize;
                }
                BPF_JEQ_K => {
                    pc += if acc == i.k { i.jt } else { i.jf } as usize;
                }
                BPF_JGE_K => {
                    pc += if acc >= i.k { i.jt } else { i.jf } as usize;
                }
                BPF_RET_K => return i.k,
                other => panic!("unknown instruction {other:#x}"),
            }
            pc += 1;
        }
    }

    #[test]
    fn listed_calls_are_refused_others_allowed_other_arches_killed() {
        let denied = denied_syscalls();
        let p = instructions(AUDIT_ARCH, &denied);
        assert!(p.len() < 255, "jumps fit in a byte");
        assert!(
            p.iter().all(|i| i.jt != u8::MAX && i.jf != u8::MAX),
            "labels resolved"
        );
        for (name, nr) in &denied {
            assert_eq!(
                run(&p, AUDIT_ARCH, *nr as u32),
                SECCOMP_RET_ERRNO | EPERM,
                "{name}"
            );
        }
        for allowed in [libc::SYS_read, libc::SYS_write, libc::SYS_execve] {
            assert_eq!(run(&p, AUDIT_ARCH, allowed as u32), SECCOMP_RET_ALLOW);
        }
        // Threads and processes may be made; a new user namespace may not.
        let clone = libc::SYS_clone as u32;
        let thread = (libc::CLONE_VM | libc::CLONE_THREAD) as u32;
        assert_eq!(run_with(&p, AUDIT_ARCH, clone, thread), SECCOMP_RET_ALLOW);
        assert_eq!(
            run_with(&p, AUDIT_ARCH, clone, thread | CLONE_NEWUSER),
            SECCOMP_RET_ERRNO | EPERM
        );
        assert_eq!(
            run(&p, AUDIT_ARCH, libc::SYS_clone3 as u32),
            SECCOMP_RET_ERRNO | ENOSYS
        );
        assert_eq!(
            run(&p, AUDIT_ARCH, X32_SYSCALL_BIT | libc::SYS_read as u32),
            SECCOMP_RET_ERRNO | EPERM
        );
        assert_eq!(run(&p, 0x4000_0003, 0), SECCOMP_RET_KILL_PROCESS);
        assert_eq!(program().expect("program").len(), p.len() * 8);
    }
}
