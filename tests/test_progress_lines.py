"""Plain progress lines for any stream: the first, then at most one per interval, and
the last."""

from experiments import progress


def test_progress_lines_say_the_first_the_last_and_one_per_interval():
  said, now = [], [0.0]
  report = progress.lines(said.append, "compiling", every_s=2.0, clock=lambda: now[0])
  for done in range(1, 11):
    now[0] = 0.5 * done
    report(done, 10)
  # 1 at 0.5 s; then 2 s later: 5 at 2.5 s, 9 at 4.5 s; and the last, 10.
  assert said == ["compiling 1/10", "compiling 5/10", "compiling 9/10", "compiling 10/10"]
