"""The package's shape: its parts stand in one order and each imports only parts below it
(function-level imports included; the order is the architecture guide's, megatrain_ray/README.md),
with no circles inside a part; the benchmark and the test harness stay out of the core; the top
level holds only the entry points, the config and the subpackages; one function assembles every
worker."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatrain_ray"
# bottom to top: a part may import the parts before it, never one after it
ORDER = ("config", "config_reference", "models", "data", "rl", "host", "files", "streaming", "objective", "planning",
         "runtime", "api", "bench", "cli", "megatrain_ray")
HARNESS = {"megatrain_ray.runtime.local"}  # the in-process trainer, for tests
TOP = {"megatrain_ray.cli", "megatrain_ray.api", "megatrain_ray"}  # entry points may reach everything
TOP_FILES = {"__init__.py", "cli.py", "api.py", "config.py", "config_reference.py",
             "objective.py"}  # entry points, the config, its reference and what a run trains for
TEST_CODE = {"pytest", "tests", "conftest", "helpers", "reference_training", "hf_parity"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every megatrain_ray module this file imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatrain_ray"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(files)) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_circles():
    graph = {name: deps - {"megatrain_ray"} for name, deps in import_graph().items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def part_of(module: str) -> str:
    """The part a module belongs to: its subpackage, or the top-level module itself."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a part above the importer's own, as "importer -> imported"."""
    rank = {part: k for k, part in enumerate(ORDER)}
    return sorted(f"{name} -> {dep}" for name, deps in graph.items() for dep in deps
                  if dep != "megatrain_ray" and rank[part_of(dep)] > rank[part_of(name)])


def test_every_part_is_in_the_order():
    assert {part_of(name) for name in import_graph()} == set(ORDER)


def test_every_import_looks_down_the_order():
    assert upward_imports(import_graph()) == []


def test_the_order_check_finds_an_import_running_up():
    graph = {"megatrain_ray.host.store": {"megatrain_ray.files.checkpoint", "megatrain_ray.models.arch"},
             "megatrain_ray.files.checkpoint": {"megatrain_ray.host.precision"}}
    assert upward_imports(graph) == ["megatrain_ray.host.store -> megatrain_ray.files.checkpoint"]


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_library_module_imports_test_harness_or_the_benchmark():
    for name, deps in import_graph().items():
        if name in TOP or name in HARNESS or name.startswith("megatrain_ray.bench"):
            continue
        assert not deps & HARNESS, f"{name} imports {deps & HARNESS}"
        assert not {d for d in deps if d.startswith("megatrain_ray.bench")}, f"{name} imports the benchmark"


def module_level_imports(path: Path) -> set[str]:
    """Every module this file imports when it is imported (not inside a function)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_only_the_benchmark_imports_the_benchmark():
    """cli.py reaches it inside the bench command alone: no other command loads it."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for name, deps in import_graph().items():
        if name.startswith("megatrain_ray.bench"):
            continue
        bench = {d for d in deps if d.startswith("megatrain_ray.bench")}
        if name == "megatrain_ray.cli":
            assert not {d for d in module_level_imports(files[name]) if d.startswith("megatrain_ray.bench")}, \
                "cli.py imports the benchmark for every command"
            continue
        assert not bench, f"{name} imports the benchmark: {bench}"


def test_the_cli_runs_without_loading_the_benchmark():
    import subprocess
    import sys

    code = ("import sys; from megatrain_ray import cli; cli.build_parser(['plan']).parse_args(['plan', 'x.yaml']); "
            "print(sorted(m for m in sys.modules if m.startswith('megatrain_ray.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_library_module_imports_test_code():
    for path in PACKAGE.rglob("*.py"):
        tops = {name.split(".")[0] for name in imports_of_any(path)}
        assert not tops & TEST_CODE, f"{module_name(path)} imports test code: {tops & TEST_CODE}"


def imports_of_any(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_top_of_the_package_holds_entry_points_config_and_subpackages():
    files = {p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix == ".py"}
    assert files == TOP_FILES, f"modules at the top beside the entry points and the config: {files - TOP_FILES}"
    for folder in (p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if any(folder.glob("*.py")):
            assert (folder / "__init__.py").exists(), f"{folder.name}/ holds modules but is not a package"


def calls(path: Path) -> set[str]:
    """The names of every function or class this file calls, and `Class.method` where the call names its class."""
    names = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Call):
            names.add(getattr(n.func, "id", getattr(n.func, "attr", None)))
            if isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name):
                names.add(f"{n.func.value.id}.{n.func.attr}")
    return names


def test_one_function_assembles_every_worker():
    """runtime/worker.py alone builds an executor, wraps the embedding's device step, joins a process
    group and starts an LR schedule (outside streaming/, whose parts they are); the GPU actor, the in-process trainer and the benchmark's
    rebuild all call its assemble_worker (tests/runtime/test_step_plan.py watches them do it)."""
    wiring = {"StreamingExecutor", "DeviceStepSource", "LrSchedule", "Group.join", "Group.solo", "build_executor",
              "with_embedding_step", "join_group"}
    for path in PACKAGE.rglob("*.py"):
        if module_name(path) != "megatrain_ray.runtime.worker" and part_of(module_name(path)) != "streaming":
            assert not calls(path) & wiring, f"{module_name(path)} wires a worker itself: {calls(path) & wiring}"
    for name in ("runtime/actors.py", "runtime/local.py", "bench/telemetry.py"):
        assert "assemble_worker" in calls(PACKAGE / name), f"{name} does not assemble through assemble_worker"


def executor_policy_calls(path: Path) -> list[int]:
    """Lines where the file calls a policy operation on an executor itself (`<x>.executor.token_logprobs(...)`,
    `self.executor.train_step(...)`) or reads the reference weights (`reference_source`)."""
    ops = {"train_step", "eval_loss", "token_logprobs"}
    lines = []
    for n in ast.walk(ast.parse(path.read_text())):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and f.attr in ops and isinstance(f.value, ast.Attribute) and f.value.attr == "executor":
            lines.append(n.lineno)
        if getattr(f, "id", getattr(f, "attr", None)) == "reference_source":
            lines.append(n.lineno)
    return lines


def test_the_trainers_share_one_policy_surface():
    """The policy's operations on a worker (a step, validation, token and reference log-probabilities)
    are written once, on runtime/worker.py's Worker: the in-process trainer and the GPU actor call it
    and never the executor's own (the Session fans the actor's out over the workers)."""
    for name in ("runtime/actors.py", "runtime/local.py"):
        assert not executor_policy_calls(PACKAGE / name), f"{name} calls the executor's policy operations itself"


def test_the_policy_call_finder_finds_them(tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text("def f(self, mbs):\n    self.reference = reference_source(1, 2, 3)\n"
                    "    return self.worker.executor.token_logprobs(mbs, self.reference)\n")
    assert executor_policy_calls(copy) == [2, 3]


def test_the_run_s_actors_inherit_nothing_from_the_benchmark():
    from megatrain_ray.runtime.actors import GpuWorker, ShardStoreActor

    for cls in (GpuWorker, ShardStoreActor):
        assert not [c for c in cls.__mro__ if c.__module__.startswith("megatrain_ray.bench")], cls.__mro__


SECTIONS = {"model", "data", "optim", "train", "executor", "runtime", "checkpoint", "eval", "metrics", "grpo"}


def config_writes(path: Path) -> list[int]:
    """The lines of `path` that write a config: Config.replace(<section>=...), or dataclasses.replace
    of a config's section (`x.train`, or a section taken from it into a name of its own)."""
    lines = []
    for n in ast.walk(ast.parse(path.read_text())):
        if not isinstance(n, ast.Call):
            continue
        name = getattr(n.func, "attr", getattr(n.func, "id", None))
        if name != "replace":
            continue
        first = n.args[0] if n.args else None
        section = (isinstance(first, ast.Attribute) and first.attr in SECTIONS) or \
                  (isinstance(first, ast.Name) and first.id in SECTIONS)
        if {k.arg for k in n.keywords} & SECTIONS or (section and not isinstance(n.func, ast.Attribute)) or \
                (section and getattr(n.func.value, "id", None) == "dataclasses"):
            lines.append(n.lineno)
    return lines


# Where a config may be written: the config itself and the CLI's --set; the planner's own copy of the
# settings, with its decisions in them, which its memory and time models read and which never
# becomes a run's config (planning/); the names settled as the config is read, before a run starts
# from it: Hub names as local paths (files/hub.py, api.prepare), a job's outputs under its home
# (runtime/job_paths.py); the benchmark, which makes a config for each shape it measures.
CONFIG_WRITERS = {"megatrain_ray.config", "megatrain_ray.cli", "megatrain_ray.files.hub", "megatrain_ray.runtime.job_paths"}


def test_nothing_writes_the_config_after_it_is_read():
    """The plan decides and the run obeys the plan: no module outside those above writes a config
    (a run's config is compared with the one read in tests/runtime/test_step_plan.py and
    tests/rl/test_grpo_run.py)."""
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name in CONFIG_WRITERS or part_of(name) in ("planning", "bench"):
            continue
        assert not config_writes(path), f"{name} writes a config at lines {config_writes(path)}"


def test_the_config_write_finder_finds_them():
    probe = PACKAGE.parent / "tests" / "entry" / "_config_writes_probe.py"
    probe.write_text("import dataclasses\nfrom dataclasses import replace\n"
                     "a = config.replace(train=t)\n"
                     "b = dataclasses.replace(config.executor, compile=False)\n"
                     "c = replace(train, steps=3)\n"
                     "d = arch.replace(num_layers=2)\n"
                     "e = dataclasses.replace(result, config={})\n")
    try:
        assert config_writes(probe) == [3, 4, 5]
    finally:
        probe.unlink()


def test_no_module_but_the_objective_s_reads_train_objective():
    """objective.py resolves train.objective into an Objective; config.py checks its allowed values.
    No other module tests the string: they ask the Objective (or the step plan it informs)."""
    for path in PACKAGE.rglob("*.py"):
        if module_name(path) in ("megatrain_ray.objective", "megatrain_ray.config"):
            continue
        reads = [n.lineno for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Attribute) and n.attr == "objective"]
        assert not reads, f"{module_name(path)} reads train.objective at lines {reads}"


def family_class_tests(path: Path, arch_classes: set[str]) -> list[int]:
    """The lines of `path` that tell a family by its class (isinstance of a model's shape class) or
    probe a family for a hook it may not have (getattr of a ModelFamily member by name)."""
    from megatrain_ray.models.family import ModelFamily

    hooks = {name for name in dir(ModelFamily) if not name.startswith("_")}
    lines = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance" and len(n.args) == 2:
            classes = n.args[1].elts if isinstance(n.args[1], ast.Tuple) else [n.args[1]]
            if {getattr(c, "id", getattr(c, "attr", None)) for c in classes} & arch_classes:
                lines.append(n.lineno)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("getattr", "hasattr") and len(n.args) >= 2 \
                and isinstance(n.args[1], ast.Constant) and n.args[1].value in hooks:
            lines.append(n.lineno)
    return lines


def test_no_caller_outside_models_tells_a_family_by_its_class():
    """The family interface (models/family.py, ModelFamily) declares every hook its callers use
    (template_kinds, template_of, what does not train, what it measures): no module outside models/
    tests a model's shape class or probes a family with getattr."""
    from megatrain_ray.models.arch import ModelArch

    arch_classes = set()
    for path in (PACKAGE / "models").rglob("*.py"):
        module = __import__(module_name(path), fromlist=["_"])
        arch_classes |= {name for name, value in vars(module).items()
                         if isinstance(value, type) and issubclass(value, ModelArch) and value is not ModelArch}
    assert {"TransformersArch", "MoeArch"} <= arch_classes
    for path in PACKAGE.rglob("*.py"):
        if part_of(module_name(path)) != "models":
            found = family_class_tests(path, arch_classes)
            assert not found, f"{module_name(path)} tells a family by its class at lines {found}"


def run_settings() -> set[str]:
    """The names of every setting of the config (model.train_vision, executor.compile, ...)."""
    import dataclasses
    import typing

    from megatrain_ray.config import Config

    sections = typing.get_type_hints(Config).values()
    return {f.name for section in sections if dataclasses.is_dataclass(section) for f in dataclasses.fields(section)}


def arch_shape_breaches(families, settings: set[str]) -> list[str]:
    """What makes an arch more than the model's shape: a field named after a setting of the run that
    its family's config.json table (ModelFamily.hf_fields) does not read, and a transformers-family
    arch field beside config.json itself (hf_config) and the shared fields read from it."""
    import dataclasses

    from megatrain_ray.models.arch import ModelArch
    from megatrain_ray.models.transformers.arch import TransformersArch

    read_from_config_json = {f.name for f in dataclasses.fields(ModelArch)} | {"hf_config"}
    breaches = []
    for fam in families:
        arch, names = fam.arch_type.__name__, sorted(f.name for f in dataclasses.fields(fam.arch_type))
        breaches += [f"{arch}.{name} is a setting of the run" for name in names
                     if name in settings and name not in {f.arch for f in fam.hf_fields}]
        if issubclass(fam.arch_type, TransformersArch):
            breaches += [f"{arch}.{name} is not read from config.json" for name in names
                         if name not in read_from_config_json]
    return breaches


def test_an_arch_holds_the_model_s_shape_only():
    """An arch (ModelArch, each family's subclass) is what a checkpoint's config.json says. A setting
    of the run reaches the code that needs it as an argument: model.train_vision (whether an
    image-text model's vision tower trains) is registry.model_layouts's, which marks the layouts
    that the stores, the executor and the plan read; no arch holds it. model.router_aux_loss_coef is
    config.json's too (the MoE families' tables read and write it)."""
    from megatrain_ray.models.registry import FAMILIES
    from megatrain_ray.models.transformers.family import TRANSFORMERS

    settings = run_settings()
    assert {"train_vision", "compute_dtype", "compile"} <= settings
    assert not arch_shape_breaches((*FAMILIES, TRANSFORMERS), settings)


def test_the_arch_check_finds_a_setting_on_an_arch():
    """The check above fails where a transformers-family arch holds model.train_vision, as it once did."""
    import dataclasses

    from megatrain_ray.models.transformers.arch import TransformersArch
    from megatrain_ray.models.transformers.family import TransformersFamily

    @dataclasses.dataclass(frozen=True)
    class WithSetting(TransformersArch):
        train_vision: bool = False

    class Family(TransformersFamily):
        arch_type = WithSetting

    assert arch_shape_breaches([Family()], run_settings()) == ["WithSetting.train_vision is a setting of the run",
                                                               "WithSetting.train_vision is not read from config.json"]


def test_every_step_decision_is_made_in_the_step_plan():
    """The deciding functions are called by planning/step_plan.py's plan_step alone (and by one
    another inside the planner): the run, the in-process trainer, `plan`, `plan --cluster`, the
    benchmark and every worker receive a StepPlan and render or obey it."""
    deciding = {"check_gpu_fit", "check_host_fit", "check_parked_fit", "choose_kept", "choose_offload", "gpu_memory",
                "host_memory", "host_parking", "embedding_step_on_device", "with_window", "window_slots"}
    planner = {"megatrain_ray.planning.step_plan", "megatrain_ray.planning.decisions", "megatrain_ray.planning.placement"}
    for path in PACKAGE.rglob("*.py"):
        if module_name(path) not in planner:
            assert not calls(path) & deciding, f"{module_name(path)} decides {calls(path) & deciding}"


# What renders a plan's settings: `megatrain-ray plan` (api.plan_live) and the benchmark's report.
PLAN_RENDERERS = {"megatrain_ray.api", "megatrain_ray.bench.run"}


def test_planning_alone_decides():
    """The deciding module (planning/decisions.py: the chunks, slots, parking, kept graphs, where the
    embedding steps, the refusals) is imported by planning/ alone: every other part receives a
    StepPlan."""
    graph = import_graph()
    for name, deps in graph.items():
        if part_of(name) != "planning":
            assert "megatrain_ray.planning.decisions" not in deps, f"{name} imports the planner's decisions"


def test_the_planner_s_view_of_the_config_never_reaches_a_run():
    """StepPlan.planned_config (the settings with the chunks and slots the plan chose) is built for
    the planner's predictions and reports: only planning/ and the plan's renderers make one, so no
    run, worker or executor is handed a config other than the one read."""
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if part_of(name) == "planning" or name in PLAN_RENDERERS:
            continue
        made = calls(path) & {"planned_config", "planner_view"}
        assert not made, f"{name} makes the planner's view of the config ({', '.join(sorted(made))})"
