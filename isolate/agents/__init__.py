"""``isolate.agents``: the sandbox patterns agent projects write by hand, over ``isolate.Sandbox``.

- ``AgentSandboxes``: one named sandbox per agent id, recreated when its
  configuration (policy, workspace, mounts, backend) changes, pruned when
  idle or old, with ``list``/``rm``/``prune``.
- ``agent_files(target)``: ``read``/``write``/``edit``/``ls`` tools for an
  agent that stay beneath a root and never follow a link: over a
  ``Sandbox`` (``SandboxFiles``) or over a plain host directory
  (``HostFiles``: openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) semantics,
  built from ``O_NOFOLLOW`` directory descriptors, one component at a time).
- ``branches(policy)``: a branch per attempt (``setup_branch``,
  ``execute_command``, ``execute_python``, ``commit_to_host``, ``clean_up``,
  ``clean_up_all``), native or Docker behind one protocol, with a fallback
  from one to the other that is warned about and recorded, never silent.
- ``wrap(argv, policy)``: the ``isolate-run`` command line that runs argv
  under the policy, for agents that only know how to prefix a command.

Everything here uses the public methods of ``Sandbox``; nothing runs outside a sandbox.
"""

from .branches import BranchStrategy, DockerBranches, NativeBranches, StrategyFallbackWarning, branches
from .command_line import wrap
from .files import AgentFiles, HostFiles, SandboxFiles, ToolError, agent_files
from .manager import AgentRecord, AgentSandboxes, SandboxConfig

__all__ = ["AgentFiles", "AgentRecord", "AgentSandboxes", "BranchStrategy", "DockerBranches", "HostFiles",
           "NativeBranches", "SandboxConfig", "SandboxFiles", "StrategyFallbackWarning", "ToolError", "agent_files",
           "branches", "wrap"]
