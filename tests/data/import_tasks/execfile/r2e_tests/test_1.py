import subprocess


def run(cmd, *args):
    return subprocess.run([cmd, *args], capture_output=True, text=True, check=True).stdout


def test_greeting_has_a_comma():
    assert run("./bin/greet", "Bob") == "Hello, Bob!\n"


def test_link_runs_the_same_script():
    assert run("./greet", "Ann") == "Hello, Ann!\n"


def test_readme_is_there():
    assert open("README.md").read().startswith("greet:")
