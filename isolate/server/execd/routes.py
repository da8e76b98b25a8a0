"""The execution API's routes (port 44772) and the egress sidecar's (port 18080).
"""

from __future__ import annotations

from starlette.routing import Route

from ..models import EGRESS_PORT, EXECD_PORT
from .access import ping
from .commands import command_logs, command_status, interrupt_command, run_command
from .contexts import (
    create_context,
    delete_context,
    delete_contexts,
    get_context,
    interrupt_code,
    list_contexts,
    run_code,
)
from .egress import delete_policy, get_policy, patch_policy
from .files import (
    chmod_files,
    download_file,
    files_info,
    list_directory,
    make_dirs,
    move_files,
    remove_dirs,
    remove_files,
    replace_content,
    search_files,
    upload_files,
)
from .metrics import metrics, watch_metrics
from .sessions import create_session, delete_session, run_in_session
from .vault import (
    create_vault,
    delete_vault,
    get_vault,
    list_bindings,
    list_credentials,
    patch_vault,
)

# Literal ports: every other port of a sandbox is forwarded (isolate.server.ports).
PREFIX = f"/sandboxes/{{sandbox_id}}/port/{EXECD_PORT}"
EGRESS = f"/sandboxes/{{sandbox_id}}/port/{EGRESS_PORT}"


routes = [
    Route(PREFIX + "/ping", ping, methods=["GET"]),
    Route(PREFIX + "/command", run_command, methods=["POST"]),
    Route(PREFIX + "/command", interrupt_command, methods=["DELETE"]),
    Route(PREFIX + "/command/status/{command_id}", command_status, methods=["GET"]),
    Route(PREFIX + "/command/{command_id}/logs", command_logs, methods=["GET"]),
    Route(PREFIX + "/session", create_session, methods=["POST"]),
    Route(PREFIX + "/session/{session_id}/run", run_in_session, methods=["POST"]),
    Route(PREFIX + "/session/{session_id}", delete_session, methods=["DELETE"]),
    Route(PREFIX + "/files/info", files_info, methods=["GET"]),
    Route(PREFIX + "/files", remove_files, methods=["DELETE"]),
    Route(PREFIX + "/files/mv", move_files, methods=["POST"]),
    Route(PREFIX + "/files/permissions", chmod_files, methods=["POST"]),
    Route(PREFIX + "/files/search", search_files, methods=["GET"]),
    Route(PREFIX + "/files/replace", replace_content, methods=["POST"]),
    Route(PREFIX + "/files/upload", upload_files, methods=["POST"]),
    Route(PREFIX + "/files/download", download_file, methods=["GET"]),
    Route(PREFIX + "/directories/list", list_directory, methods=["GET"]),
    Route(PREFIX + "/directories", make_dirs, methods=["POST"]),
    Route(PREFIX + "/directories", remove_dirs, methods=["DELETE"]),
    Route(PREFIX + "/metrics", metrics, methods=["GET"]),
    Route(PREFIX + "/metrics/watch", watch_metrics, methods=["GET"]),
    Route(EGRESS + "/policy", get_policy, methods=["GET"]),
    Route(EGRESS + "/policy", patch_policy, methods=["PATCH"]),
    Route(EGRESS + "/policy", delete_policy, methods=["DELETE"]),
    Route(EGRESS + "/credential-vault", create_vault, methods=["POST"]),
    Route(EGRESS + "/credential-vault", get_vault, methods=["GET"]),
    Route(EGRESS + "/credential-vault", patch_vault, methods=["PATCH"]),
    Route(EGRESS + "/credential-vault", delete_vault, methods=["DELETE"]),
    Route(EGRESS + "/credential-vault/credentials", list_credentials, methods=["GET"]),
    Route(EGRESS + "/credential-vault/credentials/{name}", list_credentials, methods=["GET"]),
    Route(EGRESS + "/credential-vault/bindings", list_bindings, methods=["GET"]),
    Route(EGRESS + "/credential-vault/bindings/{name}", list_bindings, methods=["GET"]),
    Route(PREFIX + "/code", run_code, methods=["POST"]),
    Route(PREFIX + "/code", interrupt_code, methods=["DELETE"]),
    Route(PREFIX + "/code/context", create_context, methods=["POST"]),
    Route(PREFIX + "/code/contexts", list_contexts, methods=["GET"]),
    Route(PREFIX + "/code/contexts", delete_contexts, methods=["DELETE"]),
    Route(PREFIX + "/code/contexts/{context_id}", get_context, methods=["GET"]),
    Route(PREFIX + "/code/contexts/{context_id}", delete_context, methods=["DELETE"]),
]
