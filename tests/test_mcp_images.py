"""isolate-mcp's sandbox_create takes an image: the sandbox's root is it, under the server's profile."""

from __future__ import annotations

import os
from pathlib import Path

import imagekit as kit
import pytest
from conftest import NAMESPACES_WHY

pytest.importorskip("mcp", reason="the mcp package is not installed (pip install 'isolate[mcp]')")

import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from test_mcp import SERVER, Client, profile

from isolate.image import Image, Store

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")


def test_sandbox_create_takes_an_image_of_the_store(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    kit.oci_layout(str(tmp_path / "box"), [kit.busybox_layer()], ref="mcp-box:1", Env=["PATH=/bin"])
    Image.load(tmp_path / "box", store=store)
    env = dict(os.environ, ISOLATE_IMAGE_STORE=store.path)

    async def main() -> None:
        params = StdioServerParameters(command=SERVER[0], args=[*SERVER[1:], "--profile", profile(tmp_path, env={
            "FROM_PROFILE": "yes"})], cwd="/tmp", env=env)
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            c = Client(session)
            sid = (await c.call("sandbox_create", image="mcp-box:1"))["sandbox_id"]
            run = await c.call("command_run", sandbox_id=sid,
                               command="cat /etc/os-release; echo $FROM_PROFILE; ls /usr 2>/dev/null || echo no-usr")
            assert run["stdout"] == "NAME=busybox-scratch\nyes\nno-usr\n", run
            assert "must be lowercase" in await c.error("sandbox_create", image="UPPER/Case")

    anyio.run(main)
