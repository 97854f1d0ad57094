"""The command lines' shared bad-input rule for argparse commands (preprocess_data, train_tokenizer, the
converters, the launchers): one `error:` line naming the flag, exit 2, no usage dump."""

import pytest

from ling2.config import cli


@pytest.mark.parametrize("argv,line", [
    (["--count", "x"], "error: argument --count: invalid int value: 'x'\n"),
    (["--count", "1", "--bogus"], "error: unrecognized arguments: --bogus\n"),
    ([], "error: the following arguments are required: --count\n"),
])
def test_a_bad_flag_is_one_error_line_and_exit_2(argv, line, capsys):
    p = cli.ArgumentParser(prog="tool")
    p.add_argument("--count", type=int, required=True)
    with pytest.raises(SystemExit) as e:
        p.parse_args(argv)
    assert e.value.code == 2 and capsys.readouterr().err == line


def test_a_commands_own_usage_error_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as e:
        cli.ArgumentParser(prog="tool").error("--shard_gb must be positive, got 0")
    assert e.value.code == 2 and capsys.readouterr().err == "error: --shard_gb must be positive, got 0\n"
