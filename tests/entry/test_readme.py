"""The README is a manual that stays true: its configuration reference is what `megatrain-ray config`
prints from config.py, every key has a description, and the files the docs link to exist."""

import dataclasses
import re
from pathlib import Path

import pytest

from megatrain_ray import cli, config
from megatrain_ray.config_reference import END, START, field_comments, readme_section, update_readme

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # wherever tests/ puts this file
README = ROOT / "README.md"
DOCS = [README, ROOT / "megatrain_ray" / "README.md", ROOT / "megatrain_ray" / "models" / "README.md",
        ROOT / "megatrain_ray" / "rl" / "README.md",
        *sorted((ROOT / "examples" / "benchmarks").glob("*.md"))]
SECTIONS = ["Install", "Quick start", "Three ways to run", "Models", "Fine-tuning and data formats",
            "Plan before you run", "Host memory modes", "Configuration reference", "Stopping and resuming",
            "Failures and exit codes", "Troubleshooting", "Performance"]


def config_command_output(capsys) -> str:
    assert cli.main(["config"]) == 0
    return capsys.readouterr().out


def test_readme_configuration_reference_is_the_config_command_output(capsys):
    printed = config_command_output(capsys)
    assert readme_section(README.read_text()) == printed, (
        "README.md's configuration reference differs from `megatrain-ray config`; regenerate it with "
        "`python -m megatrain_ray.config_reference README.md`")


def test_config_command_lists_every_key_with_its_default(capsys):
    """Each printed default, read back as a YAML value through the config's own checks, is the default."""
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip().strip("`")
            for line in config_command_output(capsys).splitlines()[2:]}
    defaults = config.Config()
    for section in dataclasses.fields(config.Config):
        values = getattr(defaults, section.name)
        for f in dataclasses.fields(values):
            key = f"{section.name}.{f.name}"
            assert key in rows, f"{key} missing"
            read = config.from_mapping(type(values), {f.name: config.load_yaml(rows[key])}, section.name)
            assert getattr(read, f.name) == getattr(values, f.name), (key, rows[key])
    assert len(rows) == sum(len(dataclasses.fields(getattr(defaults, s.name))) for s in dataclasses.fields(config.Config))


def test_every_config_key_has_a_description():
    for section in dataclasses.fields(config.Config):
        cls = type(getattr(config.Config(), section.name))
        missing = [name for name, text in field_comments(cls).items() if not text]
        assert not missing, f"{cls.__name__}: give {missing} a comment on the line that declares them"


def test_update_readme_rewrites_only_the_section(tmp_path):
    page = tmp_path / "README.md"
    page.write_text(f"# title\n\nbefore\n{START}\n| stale |\n{END}\nafter\n")
    update_readme(page)
    text = page.read_text()
    assert text.startswith("# title\n\nbefore\n") and text.endswith(f"{END}\nafter\n")
    assert "| stale |" not in text and "| `train.steps` |" in readme_section(text)


def test_readme_is_a_manual_of_at_most_400_lines_with_its_sections():
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert [s for s in SECTIONS if s not in headings] == []
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    assert not re.search(r"#\d+\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", prose), \
        "the README names an issue number or a commit hash"


def named_paths(text: str, base: Path) -> list[str]:
    """Repository paths a doc names: link targets, and `a/b.py`-like names whose first folder exists
    beside the doc or at the top of the repository (outputs of a run, such as runs/..., are not)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    links = [m for m in re.findall(r"\]\(([^)#\s]+)", prose) if "://" not in m]
    names = [m for m in re.findall(r"`([\w.-]+(?:/[\w.-]+)+/?)`", prose)
             if m.split("/")[0] not in ("runs", "out") and ((base / m.split("/")[0]).is_dir() or (ROOT / m.split("/")[0]).is_dir())]
    return links + names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_the_docs_name_exist(doc):
    missing = [p for p in named_paths(doc.read_text(), doc.parent)
               if not (doc.parent / p).exists() and not (ROOT / p).exists()]
    assert missing == [], f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def test_readme_commands_take_no_default_ray_port_and_stop_no_other_ray():
    """Another Ray on the machine (a local run's embedded one) may hold Ray's default ports, the job
    API's 8265 and its agent's 52365; and `ray stop` stops every Ray of the machine, not the one a
    recipe started."""
    lines = [line.split("#")[0] for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
             for line in block.splitlines()]
    assert not [line for line in lines if re.search(r"\bray stop\b", line)]
    assert not [line for line in lines if re.search(r"\bray\b", line) and re.search(r"\b(8265|52365)\b", line)]
