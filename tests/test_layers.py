"""The layer rules (pyproject.toml, [tool.importlinter]) hold, and the checker bites: the
same checker on a copy of the tree with one forbidden import added fails, naming it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT, "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)},
    )


def test_the_layer_contracts_are_kept() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("workers/engine.py", "import service.spec", "workers never import service"),
        ("service/api/studies.py", "import service.runner.loop", "never imports the study runner"),
        ("service/runner/loop.py", "from sqlalchemy import update", "only the store writes rows"),
        ("service/control/launch.py", "import sqlalchemy", "only the store writes rows"),
        ("service/read/prom.py", "from service.store.models import Study", "shows one face"),
        ("service/runner/loop.py", "from service.store import session", "shows one face"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    for part in ("service", "workers", "qkscope"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert contract in out.stdout.replace("\n", " ")


# "Only the store writes rows", by syntax: import-linter keeps SQLAlchemy out of the runner and
# the control plane, but the API and the read side import it to read. So every module of
# service/ outside service/store/ is also searched for the ways SQLAlchemy writes a row.
SERVICE = ROOT / "service"
WRITE_FUNCS = {"insert", "update", "delete"}  # from sqlalchemy or sqlalchemy.dialects.*
WRITABLE_FACTORIES = {"sessionmaker", "Session", "scoped_session"}  # from sqlalchemy.orm
ANY_RECEIVER = {"add_all", "merge"}  # (and bulk_*): no other object here has these methods
SESSION_WRITES = {"add", "delete"}  # only on a session: sets and dicts have .add too
RAW_WRITE = ("INSERT", "UPDATE", "DELETE", "UPSERT", "MERGE", "REPLACE", "TRUNCATE", "DROP")
# make_sessionmaker (service/store/session.py) is the writable session factory. It is called in
# exactly three places, each to construct the one writer of its process, Store(...), never to
# use the sessions directly: the API process in its lifespan, the study runner (a Ray job,
# another process) when it starts, and the runner's job when that runner could not be built
# (to fail the study; no runner, so no other writer). Any other call is a second writer.
STORE_SITES = {
    ("service/app.py", "_lifespan.lifespan"),
    ("service/runner/loop.py", "StudyRunner.__init__"),
    ("service/runner/job.py", "_build"),
    ("service/runner/job.py", "run_study"),
}


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


class _WriteFinder(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.origins: dict[str, str] = {}  # local name -> what it was imported as
        self.sessions: set[str] = set()  # names bound to a session
        self.scope: list[str] = []
        self.found: list[str] = []
        self.store_sites: set[tuple[str, str]] = set()
        self.in_store: set[int] = set()  # ids of the calls that are an argument of Store(...)

    def _flag(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.path}:{getattr(node, 'lineno', 0)}: {what}")

    def _origin(self, node: ast.AST) -> str:
        name = _dotted(node) or ""
        head, _, rest = name.partition(".")
        full = self.origins.get(head, head)
        return f"{full}.{rest}" if rest else full

    def find(self, tree: ast.Module) -> list[str]:
        for node in ast.walk(tree):  # first the imports and session names, wherever they are
            self._imports(node)
            self._session_names(node)
        self.visit(tree)
        return self.found

    def _imports(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                # `import a.b` binds a; `import a.b as c` binds c to a.b
                self.origins[a.asname or a.name.partition(".")[0]] = (
                    a.name if a.asname else a.name.partition(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                self.origins[a.asname or a.name] = f"{node.module}.{a.name}"

    def _session_names(self, node: ast.AST) -> None:
        """A parameter typed as a session, `with <...session...> as x`, `x = <...session...>()`."""
        if isinstance(node, ast.arg) and node.annotation is not None:
            hint = ast.unparse(node.annotation)
            if "Session" in hint and "maker" not in hint:
                self.sessions.add(node.arg)
        elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
            if "session" in ast.unparse(node.context_expr).lower():
                self.sessions.add(node.optional_vars.id)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            made = ast.unparse(node.value.func).lower()
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            self.sessions |= names if "session" in made else set()

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Attribute(self, node: ast.Attribute) -> None:
        # Store.sessions is the writable factory the store was built with
        if node.attr == "sessions" and (_dotted(node.value) or "").split(".")[-1] == "store":
            self._flag(node, f"{ast.unparse(node)}: the store's writable sessions")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        origin = self._origin(node.func)
        last = origin.rpartition(".")[2]
        text = ast.unparse(node.func)
        if last == "Store":
            self.in_store.update(id(a) for a in node.args)
        if origin.startswith("sqlalchemy.") and last in WRITE_FUNCS:
            self._flag(node, f"{text}(): {origin}")
        elif origin.startswith("sqlalchemy.orm.") and last in WRITABLE_FACTORIES:
            self._flag(node, f"{text}(): a writable session or factory")
        elif origin == "sqlalchemy.text" and node.args:
            sql = node.args[0]
            if isinstance(sql, ast.Constant) and str(sql.value).lstrip().upper().startswith(
                RAW_WRITE
            ):
                self._flag(node, f"text({sql.value!r}): raw SQL write")
        elif last == "make_sessionmaker":
            site = (self.path, ".".join(self.scope))
            self.store_sites.add(site)
            if site not in STORE_SITES or id(node) not in self.in_store:
                self._flag(
                    node, f"make_sessionmaker() in {site[1] or 'the module'}, not Store(...)"
                )
        elif isinstance(node.func, ast.Attribute):
            attr, receiver = node.func.attr, node.func.value
            name = (_dotted(receiver) or "").split(".")[-1]
            if attr in ANY_RECEIVER or attr.startswith("bulk_"):
                self._flag(node, f"{text}()")
            elif attr in SESSION_WRITES and (name in self.sessions or "session" in name.lower()):
                self._flag(node, f"{text}(): a session write")
            elif attr in WRITE_FUNCS and (_dotted(receiver) or "").endswith("__table__"):
                self._flag(node, f"{text}(): a table write")
        self.generic_visit(node)


def _writes(path: str, source: str) -> tuple[list[str], set[tuple[str, str]]]:
    finder = _WriteFinder(path)
    return finder.find(ast.parse(source)), finder.store_sites


def test_only_the_store_writes_rows_by_syntax() -> None:
    found: list[str] = []
    sites: set[tuple[str, str]] = set()
    files = sorted(p for p in SERVICE.rglob("*.py") if (SERVICE / "store") not in p.parents)
    assert len(files) > 40  # the walk found the tree
    for p in files:
        hits, where = _writes(p.relative_to(ROOT).as_posix(), p.read_text())
        found += hits
        sites |= where
    assert not found, "only service/store/ writes rows:\n" + "\n".join(found)
    # the allowed list stays true: each site still makes the one writer, Store(...)
    assert sites == STORE_SITES


@pytest.mark.parametrize(
    "snippet",
    [
        "from sqlalchemy import insert\ndef f(s):\n    s.execute(insert(T))",
        "from sqlalchemy import update as up\nup(T).values(x=1)",
        "import sqlalchemy as sa\nsa.delete(T)",
        "from sqlalchemy.dialects import postgresql\npostgresql.insert(T).on_conflict_do_nothing()",
        "from sqlalchemy.dialects.sqlite import insert\ninsert(T)",
        "from sqlalchemy.orm import Session\nwith Session(engine) as s:\n    pass",
        "from sqlalchemy import text\nconn.execute(text('UPDATE qk_trial SET state = 1'))",
        "def f(session):\n    session.add(Trial())",
        "def f(s: SessionDep):\n    s.delete(row)",
        "with session_scope(factory) as s:\n    s.add(row)",
        "def f(db):\n    db.add_all(rows)",
        "def f(db):\n    db.merge(row)",
        "def f(db):\n    db.bulk_save_objects(rows)",
        "Trial.__table__.insert()",
        "def f(app):\n    app.state.store.sessions()",
        "from service.store.session import make_sessionmaker\nmake_sessionmaker(engine)",
        "class StudyRunner:\n    def run(self):\n        make_sessionmaker(self.engine)",
        "class StudyRunner:\n    def __init__(self):\n        self.s = make_sessionmaker(e)",
    ],
)
def test_the_write_finder_bites(snippet: str) -> None:
    path = "service/runner/loop.py" if "StudyRunner" in snippet else "service/api/x.py"
    assert _writes(path, snippet)[0], snippet


def test_the_write_finder_leaves_reads_alone() -> None:
    snippet = (
        "from sqlalchemy import select, func\n"
        "def f(session: SessionDep, members: set[int], d: dict):\n"
        "    members.add(1)\n    d.update(x=1)\n    lock.update(pid=1)\n"
        "    session.scalars(select(T).where(func.count() > 1))\n"
        "    store.trials.finish(1)\n"
    )
    assert _writes("service/api/x.py", snippet)[0] == []
    store = "class StudyRunner:\n    def __init__(self, e):\n        Store(make_sessionmaker(e))"
    site = ("service/runner/loop.py", "StudyRunner.__init__")
    assert _writes(site[0], store) == ([], {site})  # the allowed construction of the writer
