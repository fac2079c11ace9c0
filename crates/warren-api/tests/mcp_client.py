#!/usr/bin/env python3
"""A real MCP client for warrend's /mcp endpoint, built on the official MCP Python SDK.

The MCP end-to-end tests run it so that warrend is checked against a third-party client
rather than against our own code. Run it with the interpreter of the venv that
scripts/mcp-venv.sh creates:

    $VENV/bin/python mcp_client.py --url http://127.0.0.1:PORT/mcp --token-file F --script MODE ...

Modes (each prints ONE JSON object on stdout when it succeeds):
  list    {"server": {...}, "protocol_version": ..., "tools": [{"name", "inputSchema"}, ...]}
  python  creates a VM (--request-id, optional --image), runs --command in it (default:
          python3 -c 'print(6*7)'), follows the job's output with vm_job_output cursors until
          it completes, and prints {"vm_id", "stdout", "exit_code"}. The VM is left running
          unless --destroy is given.
  call    calls --tool with the JSON object --args and prints
          {"is_error", "structured", "text"} (text: the first text content, or null).

--protocol handshake (default) uses the initialize handshake and a stateful MCP session;
--protocol discover uses server/discover and the stateless 2026-07-28 protocol.

Any unexpected failure (connection, protocol, a tool error in `python` mode) prints one line
on stderr and exits 1; bad usage exits 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import anyio
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

try:  # the SDK's client with its recommended MCP timeouts
    from mcp.shared._httpx_utils import create_mcp_http_client
except ImportError:  # pragma: no cover - only if the SDK moves its helper
    create_mcp_http_client = None

DEFAULT_COMMAND = "python3 -c 'print(6*7)'"
EXEC_WAIT_MS = 20000
OUTPUT_WAIT_MS = 10000


class ClientError(Exception):
    """An expected-shape failure worth one line on stderr."""


class HttpErrors:
    """Remembers the HTTP errors the server answered with: the SDK reports them only as a
    generic "Server returned an error response", while warrend's body names the cause."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def hook(self, response: Any) -> None:
        if response.status_code >= 400:
            body = (await response.aread()).decode("utf-8", "replace").strip()
            self.seen.append(f"HTTP {response.status_code} {response.request.method}: {body[:500]}")


class QuietSessionClose(logging.Filter):
    """rmcp answers the session DELETE with 202 Accepted, which this SDK version logs as a
    failed termination although the session is closed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Session termination failed: 202")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the MCP endpoint, e.g. http://127.0.0.1:8090/mcp")
    p.add_argument("--token-file", required=True, help="file holding the bearer token")
    p.add_argument("--script", required=True, choices=["list", "python", "call"])
    p.add_argument("--protocol", choices=["handshake", "discover"], default="handshake")
    p.add_argument("--timeout", type=float, default=600.0, help="overall deadline in seconds")
    p.add_argument("--request-id", help="python: vm_create's request_id (vm_exec's gets '-exec')")
    p.add_argument("--image", help="python: the image name for vm_create")
    p.add_argument("--command", default=DEFAULT_COMMAND, help="python: the command to run")
    p.add_argument("--destroy", action="store_true", help="python: destroy the VM at the end")
    p.add_argument("--tool", help="call: the tool's name")
    p.add_argument("--args", default="{}", help="call: the arguments, a JSON object")
    a = p.parse_args(argv)
    if a.script == "python" and not a.request_id:
        p.error("--script python needs --request-id")
    if a.script == "call":
        if not a.tool:
            p.error("--script call needs --tool")
        try:
            a.args = json.loads(a.args)
        except json.JSONDecodeError as e:
            p.error(f"--args is not JSON: {e}")
        if not isinstance(a.args, dict):
            p.error("--args must be a JSON object")
    return a


def read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ClientError(f"cannot read the token file: {e}") from e
    if not token:
        raise ClientError(f"the token file {path} is empty")
    return token


def first_text(result: Any) -> str | None:
    for block in result.content or []:
        if getattr(block, "type", None) == "text":
            return block.text
    return None


async def call_tool(session: ClientSession, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Calls a tool that must succeed; returns its structured content."""
    result = await session.call_tool(name, args)
    if result.is_error:
        raise ClientError(f"{name} failed: {first_text(result) or result.structured_content}")
    if not isinstance(result.structured_content, dict):
        raise ClientError(f"{name} returned no structured content: {first_text(result)!r}")
    return result.structured_content


async def list_tools(session: ClientSession) -> list[Any]:
    from mcp import types

    tools: list[Any] = []
    cursor = None
    while True:
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


async def script_list(session: ClientSession, _a: argparse.Namespace) -> dict[str, Any]:
    tools = await list_tools(session)
    info = session.server_info
    return {
        "server": {"name": info.name, "version": info.version} if info else None,
        "protocol_version": session.protocol_version,
        "tools": [{"name": t.name, "inputSchema": t.input_schema} for t in tools],
    }


async def script_python(session: ClientSession, a: argparse.Namespace) -> dict[str, Any]:
    names = {t.name for t in await list_tools(session)}
    missing = {"vm_create", "vm_exec", "vm_job_output"} - names
    if missing:
        raise ClientError(f"the server does not list {sorted(missing)}; it lists {sorted(names)}")

    create: dict[str, Any] = {"request_id": a.request_id}
    if a.image:
        create["image"] = a.image
    vm = await call_tool(session, "vm_create", create)
    vm_id = vm.get("vm_id")
    if not isinstance(vm_id, str):
        raise ClientError(f"vm_create returned no vm_id: {vm}")

    page = await call_tool(
        session,
        "vm_exec",
        {
            "vm_id": vm_id,
            "request_id": f"{a.request_id}-exec",
            "command": a.command,
            "wait_ms": EXEC_WAIT_MS,
        },
    )
    job_id = page.get("job_id")
    stdout = page.get("stdout") or ""
    # A completed page may still be followed by more output (pages are bounded): read on
    # until a completed page brings nothing new.
    while not (page.get("state") == "completed" and not page.get("stdout") and not page.get("stderr")):
        page = await call_tool(
            session,
            "vm_job_output",
            {"vm_id": vm_id, "job_id": job_id, "cursor": page["next_cursor"], "wait_ms": OUTPUT_WAIT_MS},
        )
        stdout += page.get("stdout") or ""

    if a.destroy:
        await call_tool(session, "vm_destroy", {"vm_id": vm_id})
    return {"vm_id": vm_id, "stdout": stdout, "exit_code": page.get("exit_code")}


async def script_call(session: ClientSession, a: argparse.Namespace) -> dict[str, Any]:
    result = await session.call_tool(a.tool, a.args)
    return {
        "is_error": bool(result.is_error),
        "structured": result.structured_content,
        "text": first_text(result),
    }


SCRIPTS = {"list": script_list, "python": script_python, "call": script_call}


async def run(a: argparse.Namespace, errors: HttpErrors) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {read_token(a.token_file)}"}
    if create_mcp_http_client is not None:
        http = create_mcp_http_client(headers=headers)
    else:  # pragma: no cover
        import httpx2

        http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))
    http.event_hooks = {"request": [], "response": [errors.hook]}
    with anyio.fail_after(a.timeout):
        async with http:
            async with streamable_http_client(a.url, http_client=http) as (read, write):
                async with ClientSession(read, write) as session:
                    if a.protocol == "discover":
                        await session.discover()
                    else:
                        await session.initialize()
                    return await SCRIPTS[a.script](session, a)


def leaf_errors(e: BaseException) -> list[BaseException]:
    """The real failures inside (possibly nested) exception groups from anyio task groups."""
    inner = getattr(e, "exceptions", None)
    if isinstance(inner, (list, tuple)) and inner:
        return [leaf for sub in inner for leaf in leaf_errors(sub)]
    return [e]


def describe(e: BaseException, timeout: float) -> str:
    if isinstance(e, ClientError):
        return str(e)
    if isinstance(e, TimeoutError):
        return f"timed out after {timeout:g}s"
    error = getattr(e, "error", None)  # MCPError: the JSON-RPC error, with its data
    if error is not None and getattr(error, "data", None) is not None:
        return f"{type(e).__name__}: {e} (code {error.code}, data {json.dumps(error.data)})"
    return f"{type(e).__name__}: {e}"


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    logging.getLogger("mcp.client.streamable_http").addFilter(QuietSessionClose())
    errors = HttpErrors()
    try:
        out = anyio.run(run, a, errors)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - report every failure as one line, exit 1
        msgs = [describe(leaf, a.timeout) for leaf in leaf_errors(e)] + errors.seen
        print(f"mcp_client: {a.script}: {'; '.join(msgs)}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
