"""The README's quickstart runs as written: its code blocks, in order, in a fresh folder, on the CPU; and it
names only the user settings among the package's environment variables."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quickstart_blocks() -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block between '## Quickstart' and the next section."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)


def test_quickstart_has_python_and_shell_blocks():
    languages = [lang for lang, _ in quickstart_blocks()]
    assert languages.count("python") >= 2 and languages.count("bash") >= 2, languages


def test_quickstart_runs_as_written(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # the adaptiveload command
    for index, (language, code) in enumerate(quickstart_blocks()):
        cmd = [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"block {index} ({language}) failed:\n{code}\n{proc.stderr[-3000:]}"
        if language == "python" and "print(" in code:
            assert proc.stdout.strip(), f"block {index} printed nothing"
    assert (tmp_path / "runs" / "plan.json").is_file()


def test_names_only_the_user_settings():
    """The kernels choose their launch settings themselves: the README names no environment variable
    of the package but the three user settings."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        named = set(re.findall(r"ADAPTIVELOAD_\w+", f.read()))
    assert named == {"ADAPTIVELOAD_DISABLE", "ADAPTIVELOAD_CACHE", "ADAPTIVELOAD_REQUIRE_KERNEL"}, named
