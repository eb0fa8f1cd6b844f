from fastpar.cli import run

run()
