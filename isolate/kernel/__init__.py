"""The kernel mechanisms, each applied from the host's side: one module per mechanism.

``landlock`` (rights per ABI), ``seccomp`` (profiles and the BPF compiler),
``cgroup`` (v1 and v2), ``mounts`` (the built root), ``overlay`` (an overlay
workspace), ``grants`` (host paths resolved and re-checked), ``beneath`` (a path
opened below a directory descriptor, no link followed: openat2), ``tree`` (a
workspace's tree walked, compared, copied by descriptor), ``places`` (the
state and runtime directories), ``way`` (who could change the way to a
directory used by path: the state directory's and the image store's one
rule), ``hostinfo`` (what this host is), ``fdwait`` and ``peerchannel``
(descriptors waited on, and a socket kept to one writer). The child-side half
of each is C, in csrc/, behind ``isolate._core``.

May import: ``isolate.model`` and ``isolate._core``. The backends, runners
and everything outside import it.
"""
