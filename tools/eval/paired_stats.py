"""The two intervals every eval tool reports, the same rules `fluxion eval tasks` prints
(bench/eval/task_eval.h): Wilson for an accuracy, Wald on the discordant pairs for a paired
difference (McNemar's view of it)."""
import math


def wilson95(correct, n):
    """95% Wilson interval of correct / n; (0, 0) for n == 0."""
    if n == 0:
        return 0.0, 0.0
    z = 1.96
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference95(lost, gained, n):
    """(gained - lost) / n with its 95% interval: (delta, low, high); zeros for n == 0."""
    if n == 0:
        return 0.0, 0.0, 0.0
    delta = (gained - lost) / n
    var = max(0.0, (gained + lost) / n - delta * delta)
    half = 1.96 * math.sqrt(var / n)
    return delta, delta - half, delta + half
