"""The kernel's seccomp values (return actions, limits, flags of the calls the profiles look at) and
the OCI profile vocabulary (operators, actions, architectures, keys).
"""

from __future__ import annotations

BUILTIN_PROFILES = ("default", "strict", "none")


INSTALL_HINT = "seccomp needs libseccomp: apt-get install libseccomp2 (and pip install pyseccomp)"


# Kernel return actions (include/uapi/linux/seccomp.h).
RET_KILL_PROCESS = 0x80000000


RET_KILL_THREAD = 0x00000000


RET_TRAP = 0x00030000


RET_ERRNO = 0x00050000


RET_USER_NOTIF = 0x7FC00000


RET_TRACE = 0x7FF00000


RET_LOG = 0x7FFC0000


RET_ALLOW = 0x7FFF0000


_RET_ACTION_FULL = 0xFFFF0000


_RET_DATA = 0x0000FFFF


#: The kernel's limit on the length of one filter (BPF_MAXINSNS).
MAX_INSTRUCTIONS = 4096


#: The largest errno a filter may return (MAX_ERRNO).
MAX_ERRNO = 4095


# libseccomp comparison operators (enum scmp_compare).
_OPS = {
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}


_ACTIONS = (
    "SCMP_ACT_KILL",
    "SCMP_ACT_KILL_THREAD",
    "SCMP_ACT_KILL_PROCESS",
    "SCMP_ACT_TRAP",
    "SCMP_ACT_ERRNO",
    "SCMP_ACT_TRACE",
    "SCMP_ACT_LOG",
    "SCMP_ACT_ALLOW",
    "SCMP_ACT_NOTIFY",
)


_SCMP_ARCHES = (
    "SCMP_ARCH_NATIVE", "SCMP_ARCH_X86", "SCMP_ARCH_X86_64", "SCMP_ARCH_X32", "SCMP_ARCH_ARM",
    "SCMP_ARCH_AARCH64", "SCMP_ARCH_LOONGARCH64", "SCMP_ARCH_M68K", "SCMP_ARCH_MIPS", "SCMP_ARCH_MIPS64",
    "SCMP_ARCH_MIPS64N32", "SCMP_ARCH_MIPSEL", "SCMP_ARCH_MIPSEL64", "SCMP_ARCH_MIPSEL64N32", "SCMP_ARCH_PPC",
    "SCMP_ARCH_PPC64", "SCMP_ARCH_PPC64LE", "SCMP_ARCH_S390", "SCMP_ARCH_S390X", "SCMP_ARCH_PARISC",
    "SCMP_ARCH_PARISC64", "SCMP_ARCH_RISCV64", "SCMP_ARCH_SH", "SCMP_ARCH_SHEB",
)


_FLAGS = (
    "SECCOMP_FILTER_FLAG_TSYNC",
    "SECCOMP_FILTER_FLAG_LOG",
    "SECCOMP_FILTER_FLAG_SPEC_ALLOW",
    "SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV",
)


_TOP_KEYS = frozenset(
    {"defaultAction", "defaultErrnoRet", "architectures", "archMap", "syscalls", "flags", "listenerPath",
     "listenerMetadata", "comment"}
)


_ENTRY_KEYS = frozenset({"names", "name", "action", "args", "errnoRet", "comment", "includes", "excludes"})


_ARG_KEYS = frozenset({"index", "value", "valueTwo", "op"})


_FILTER_KEYS = frozenset({"caps", "arches", "minKernel"})


# Native architectures: AUDIT_ARCH value -> (SCMP_ARCH name, names used by Docker's includes/excludes).
_ARCH_NAMES: dict[int, tuple[str, frozenset[str]]] = {
    0xC000003E: ("SCMP_ARCH_X86_64", frozenset({"amd64", "x86_64"})),
    0x40000003: ("SCMP_ARCH_X86", frozenset({"386", "x86", "i386"})),
    0xC00000B7: ("SCMP_ARCH_AARCH64", frozenset({"arm64", "aarch64"})),
    0x40000028: ("SCMP_ARCH_ARM", frozenset({"arm"})),
    0xC0000015: ("SCMP_ARCH_PPC64LE", frozenset({"ppc64le"})),
    0x80000016: ("SCMP_ARCH_S390X", frozenset({"s390x"})),
    0xC00000F3: ("SCMP_ARCH_RISCV64", frozenset({"riscv64"})),
}


_AUDIT_ARCH_X86_64 = 0xC000003E


# x86_64 system calls newer than libseccomp 2.5.4 knows (arch/x86/entry/syscalls/syscall_64.tbl).
_X86_64_NEWER: dict[str, int] = {
    "uretprobe": 335,
    "uprobe": 336,
    "statmount": 457,
    "listmount": 458,
    "lsm_get_self_attr": 459,
    "lsm_set_self_attr": 460,
    "lsm_list_modules": 461,
    "mseal": 462,
    "setxattrat": 463,
    "getxattrat": 464,
    "listxattrat": 465,
    "removexattrat": 466,
    "open_tree_attr": 467,
    "file_getattr": 468,
    "file_setattr": 469,
    "listns": 470,
}


# Constants used by the built-in profiles.
_AF_UNIX = 1


_AF_VSOCK = 40


_TIOCSTI = 0x5412


_TIOCLINUX = 0x541C


_LOW32 = 0xFFFFFFFF


_CLONE_NEWTIME = 0x00000080


_CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


# personality() flags that weaken the process (the kernel's PER_CLEAR_ON_SETID).
_UNSAFE_PERSONA = (0x0040000, 0x0100000, 0x0200000, 0x0400000)  # ADDR_NO_RANDOMIZE, MMAP_PAGE_ZERO, ...


_CACHE_SIZE = 64
