"""The layer rules of docs/architecture.md, checked against the code's own imports.

Each room (a package under ``src/forkd``, or a top-level module) may import only what its rule
names: whole rooms, or single modules of a room (``guest.protocol``); no two files may import each
other in a loop. Imports under ``if TYPE_CHECKING:`` count too: a type a room needs is a dependency
of that room. The fronts reach the runtime only through its front surface, and no file grows past
500 lines.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
BASE = {"config", "validation", "errors", "hostpaths", "safetext", "listeners", "extras"}  # small shared modules every room may use
FACE = {"forkd"}  # the package itself: its version and public names
MAX_LINES = 500

#: room -> what it may import besides itself: rooms, or ``room.module`` for one module of a room.
#: Keep in step with the room table of docs/architecture.md.
ALLOWED: dict[str, set[str]] = {
    "guest": set(),  # runs inside the VM on the guest's Python: stdlib only
    "config": set(),
    "validation": set(),
    "errors": set(),
    "hostpaths": {"validation"},
    "safetext": set(),
    "listeners": set(),
    "extras": set(),
    "vmm": {"guest.protocol", "guest.netconf"} | BASE,  # netconf: the guest network the command line sets up
    "store": {"guest.protocol", "vmm.base", "vmm.disk"} | BASE,
    "host": {"guest.netconf", "vmm"} | BASE,
    "image": {"guest", "store", "host"} | BASE,
    "packs": {"store", "vmm", "guest"} | BASE | FACE,
    "runtime": {"vmm", "host", "store", "image", "packs", "guest"} | BASE,
    # not guest: what runs in a sandbox goes through runtime's sessions (budgets, flow control, deadlines)
    "e2b": {"runtime", "vmm", "host", "store", "image"} | BASE | FACE,
    "daemon": {"runtime", "e2b", "vmm", "host", "store", "image", "packs", "guest"} | BASE | FACE,
    "sdk": {"guest.protocol"} | BASE,
    # a client of the daemons across a Ray cluster (needs the forkd[ray] extra): the SDK and the node API only
    "cluster": {"sdk"} | BASE | FACE,
    # daemon: `forkd daemon` runs it; host: the preflight before any daemon exists; packs: `forkd index add`
    # edits an index file on the client's own disk; cluster: `forkd cluster`, imported inside its commands
    "cli": {"sdk", "daemon", "host", "packs", "cluster"} | BASE | FACE,
    "mcp": {"sdk"} | BASE | FACE,
    # agent frameworks (LangChain, AutoGen) over the SDK, each behind its own extra
    "integrations": {"sdk"} | BASE | FACE,
    "forkd": {"sdk"} | BASE,
    "__main__": {"cli"},
}
#: The fronts that serve a Runtime; they use only its FRONT_SURFACE (forkd.runtime.runtime).
FRONTS = ("daemon", "e2b")


@functools.cache
def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree, read and parsed once per run (the checks below all walk the same files).

    A file that does not parse fails here, named: CPython 3.11's parser reports some invalid source as
    ``SystemError`` (cpython#135426, an f-string cut off: a file read while an editor rewrites it in
    place, or left half-edited), which said neither which file nor that it was a syntax error."""
    try:
        return ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, SystemError, ValueError) as exc:
        raise AssertionError(f"{path} does not parse ({type(exc).__name__}: {exc}); if it was being edited, "
                             "run this test again once it is saved") from exc


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports(path: Path) -> Iterator[str]:
    """Every ``forkd`` module ``path`` imports, absolute or relative (``from forkd.guest import protocol``
    is an import of ``forkd.guest.protocol``)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.split(".")[0] == "forkd")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "forkd":
                continue
            for alias in node.names:
                submodule = SRC.joinpath(*f"{target}.{alias.name}".split("."))
                is_module = submodule.with_suffix(".py").is_file() or (submodule / "__init__.py").is_file()
                yield f"{target}.{alias.name}" if is_module else target


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (SRC / "forkd").rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for target in imports(path):
            while target not in files and "." in target:  # `from forkd.x import name` names a module or a name
                target = target.rpartition(".")[0]
            if target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def test_every_room_has_a_rule() -> None:
    rooms = {room_of(name) for name in graph()}
    assert rooms <= set(ALLOWED), f"rooms without a rule in this test and docs/architecture.md: {rooms - set(ALLOWED)}"


def allowed(room: str, target: str) -> bool:
    """Whether ``room`` may import module ``target``: its own, or a room or module its rule names."""
    parts = target.split(".")[1:] or ["forkd"]
    return room_of(target) == room or any(".".join(parts[:n]) in ALLOWED[room] for n in range(1, len(parts) + 1))


def test_rooms_import_only_what_their_rule_allows() -> None:
    broken = sorted(f"{name} -> {target}" for name, targets in graph().items() for target in targets
                    if not allowed(room_of(name), target))
    assert broken == []


def test_the_rule_reads_modules_and_rooms() -> None:
    """The checker itself: a module rule admits that module only, a room rule the whole room."""
    assert allowed("store", "forkd.guest.protocol") and not allowed("store", "forkd.guest.agent")
    assert allowed("runtime", "forkd.store.registry") and not allowed("runtime", "forkd.daemon.app")
    assert not allowed("e2b", "forkd.guest.protocol")  # E2B is an adapter over runtime's sessions
    assert allowed("daemon", "forkd") and not allowed("runtime", "forkd")
    assert "forkd.guest.protocol" in set(imports(SRC / "forkd" / "store" / "layout.py")) | set(
        imports(SRC / "forkd" / "store" / "snapshots.py"))


def runtime_uses(tree: ast.AST) -> Iterator[ast.Attribute]:
    """``runtime.X`` and ``self.runtime.X``: what a front takes from the Runtime it serves."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "runtime") or \
                    (isinstance(base, ast.Attribute) and base.attr == "runtime"):
                yield node


def test_fronts_use_only_the_runtime_front_surface() -> None:
    """Routes and the E2B front use the runtime's services and facade methods, never its registry,
    store, VMM or the pool's internals (``runtime.sandboxes.pool``)."""
    from forkd.runtime.runtime import FRONT_SURFACE, Runtime

    assert all(hasattr(Runtime, name) or name in Runtime.__init__.__code__.co_names for name in FRONT_SURFACE)
    offenders = []
    for front in FRONTS:
        for path in sorted((SRC / "forkd" / front).rglob("*.py")):
            tree = parsed(path)
            offenders += [f"{path.relative_to(SRC)}:{use.lineno} runtime.{use.attr}" for use in runtime_uses(tree)
                          if use.attr not in FRONT_SURFACE]
            offenders += [f"{path.relative_to(SRC)}:{node.lineno} .{node.attr}" for node in ast.walk(tree)
                          if isinstance(node, ast.Attribute) and node.attr in {"pool", "registry", "store"}
                          and isinstance(node.value, ast.Attribute) and node.value.attr in {"runtime", "sandboxes"}]
    assert offenders == []


def test_no_file_over_the_line_limit() -> None:
    """One concept per module keeps modules short: past MAX_LINES a file is split by concept."""
    long = sorted(f"{path.relative_to(SRC)}: {lines}" for path in (SRC / "forkd").rglob("*.py")
                  if (lines := len(path.read_text().splitlines())) > MAX_LINES)
    assert long == []


def test_no_import_cycles() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


#: The backend-neutral seam of vmm/ (docs/architecture.md, "VMM backends"): the core protocol and data
#: types, the disk format, the optional branching capability, VMM processes and paging out their memory,
#: the registry of backends.
VMM_SEAM = {"forkd.vmm.base", "forkd.vmm.disk", "forkd.vmm.branching", "forkd.vmm.process", "forkd.vmm.pageout",
            "forkd.vmm.backends"}
#: What store/ and packs/ may use of it: data types and the disk format, never a backend or the runtime's half.
VMM_TYPES = {"forkd.vmm.base", "forkd.vmm.disk"}
#: Rooms outside vmm/ that may reach a concrete backend: host/ (doctor reports QEMU, its machine and CPU).
BACKEND_USERS = {"host"}


def test_no_room_reaches_past_the_vmm_seam() -> None:
    """The daemon picks its backend through vmm.backends; store/, packs/ and runtime/ get the one it
    picked (its Vmm and DiskFormat) and never import QEMU's or the fake's modules."""
    broken = sorted(
        f"{name} -> {target}" for name, targets in graph().items() for target in targets
        if room_of(target) == "vmm" and room_of(name) != "vmm"
        and not (target in (VMM_TYPES if room_of(name) in ("store", "packs") else VMM_SEAM)
                 or room_of(name) in BACKEND_USERS))
    assert broken == []


def test_qemu_s_disk_format_is_named_only_in_vmm() -> None:
    """qcow2 is the QEMU backend's disk format (vmm/qemu_disk.py): no other room may know it."""
    leaks = sorted(f"{path.relative_to(SRC)}:{number}" for path in (SRC / "forkd").rglob("*.py")
                   if "vmm" not in path.relative_to(SRC / "forkd").parts[:1]
                   for number, line in enumerate(path.read_text().splitlines(), 1) if "qcow2" in line.lower())
    assert leaks == []
    assert "qcow2" in (SRC / "forkd" / "vmm" / "qemu_disk.py").read_text()  # the check looks where the name lives


def registry_writes() -> set[str]:
    """The Registry's methods that write: every public one but the readers."""
    from forkd.store.registry import Registry

    readers = ("get_", "list_", "snapshot_children", "pool_sizes", "leases", "close")
    return {name for name in vars(Registry) if not name.startswith(("_", *readers))}


def test_no_registry_write_runs_on_the_event_loop() -> None:
    """A write waits for SQLite's lock (up to its busy timeout) and may checkpoint the log: inside a
    coroutine it goes through a thread (``asyncio.to_thread(registry.x, ...)``), never a direct call."""
    writes = registry_writes() | {"register_writing", "mark_failed"}  # SnapshotStore's own writes
    assert {"add_sandbox", "set_end_at", "publish_snapshots"} <= writes
    offenders = []
    for path in SRC.rglob("*.py"):
        for function in ast.walk(parsed(path)):
            if isinstance(function, ast.AsyncFunctionDef):
                offenders += [f"{path.relative_to(SRC)}:{call.lineno} {ast.unparse(call.func)}"
                              for call in direct_calls(function) if call.func.attr in writes]
    assert offenders == []


def direct_calls(function: ast.AsyncFunctionDef) -> Iterator[ast.Call]:
    """Method calls made in ``function``'s own body and not awaited (a coroutine method is not a
    blocking one), leaving out functions and lambdas defined inside it."""
    pending: list[ast.AST] = list(function.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Await) and isinstance(node.value, ast.Call):
            pending.extend(ast.iter_child_nodes(node.value))  # its arguments may still call
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def test_the_sdk_core_waits_for_nothing_itself() -> None:
    """``sdk/sandbox/`` is the one core of ``Sandbox`` and ``AsyncSandbox``: it builds requests and reads
    answers as step generators, and the flavours wait. So it imports no HTTP client, no event loop and
    neither client nor flavour package (each of those imports it)."""
    core = SRC / "forkd" / "sdk" / "sandbox"
    clients = ("forkd.sdk.controller", "forkd.sdk.async_controller", "forkd.sdk.operations", "forkd.sdk.answers", "forkd.sdk.calls",
               "forkd.sdk.sandbox_sync", "forkd.sdk.sandbox_async")
    for path in core.glob("*.py"):
        tree = parsed(path)
        top = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
        top |= {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert not top & {"httpx", "asyncio", "anyio", "threading", "socket"}, (path.name, top)
        assert not [name for name in imports(path) if name.startswith(clients)], path.name
