"""The first command, `kiln build` with no arguments, keeps the engine it built and says what to try next."""

from kiln.cli import main


def test_first_command_saves_its_engine_and_prints_the_next_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["build", "--device=cpu", "--iterations=3", "--warmUp=0"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "kiln-default.kiln").stat().st_size > 0
    assert "Engine saved to kiln-default.kiln in the current directory" in out
    assert "Next: kiln inspect kiln-default.kiln" in out
    assert main(["inspect", "kiln-default.kiln"]) == 0  # the next command works as printed


def test_an_explicit_destination_writes_nothing_into_the_current_directory(tmp_path, monkeypatch, capsys):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["build", "--device=cpu", f"--saveEngine={tmp_path / 'e.kiln'}", "--skipInference"]) == 0
    assert list(work.iterdir()) == [] and (tmp_path / "e.kiln").exists()
    assert f"Next: kiln inspect {tmp_path / 'e.kiln'}" in capsys.readouterr().out
