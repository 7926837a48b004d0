"""The live view of a search: one progress bar while trials run, each trial streamed to TensorBoard. Apart from the
end-of-search report: it holds state (the bar, the best so far) and runs per finished trial, inside the search loop."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from lightning_ckpt.budget import Budget
from lightning_ckpt.formatting import count
from lightning_ckpt.report.tensorboard import log_trial
from lightning_ckpt.report.text import trial_line
from lightning_ckpt.search.ledger import TrialRecord

__all__ = ["SearchProgress"]


class SearchProgress:
    """What a user watches during the search: one progress bar, nothing else unless ``verbose``.

    ``total``: how many plans at most will be measured, or None when the time model may stop early: the bar then counts
    with no fraction and no ETA, not a ``2/14`` that never fills. Called with each finished trial (a ``ProgressFn``);
    the callback pauses Lightning's own bar around it."""

    def __init__(
        self,
        total: int | None,
        *,
        writer: SummaryWriter | None = None,
        verbose: bool = False,
        enabled: bool = True,
        file: Any = None,
    ) -> None:
        from tqdm.auto import tqdm

        self.writer, self.verbose, self.enabled = writer, verbose, enabled
        self.best: float | None = None
        self.pruned = 0  # by the memory model
        self.pruned_by_time = 0
        self._phase: str | None = None  # the side-by-side rounds being drawn (``rounds``), None while trials run
        desc = "lightning_ckpt: tuning"
        self.bar = tqdm(
            total=total, desc=desc, unit="plan", disable=not enabled, leave=False, file=file, dynamic_ncols=True
        )

    def __call__(self, trial: TrialRecord, budget: Budget) -> None:
        if trial.feasible and trial.samples_per_second is not None:
            self.best = max(self.best or 0.0, trial.samples_per_second)
        if self.writer is not None:
            log_trial(self.writer, trial, best_samples_per_second=self.best)
        if self.verbose:
            self.write(trial_line(trial, budget))
        if self._phase is not None:
            return  # a plan verified after the rounds (its memory measured): the rounds' line stays as it is
        if trial.status == "pruned" and trial.pruned_by == "time":
            self.pruned_by_time += 1  # as below
        elif trial.status == "pruned":
            self.pruned += 1  # costs no step and does not count towards n_trials: not a step of the bar
        else:
            if self.bar.total is not None and self.bar.n >= self.bar.total:
                self.bar.total = self.bar.n + 1
            self.bar.update(1)
        postfix = [f"best {self.best:.1f} samples/s"] if self.best is not None else []
        postfix += [f"{self.pruned} ruled out by the memory model"] if self.pruned else []
        postfix += [f"{self.pruned_by_time} by the time model"] if self.pruned_by_time else []
        self.bar.set_postfix_str(", ".join(postfix))

    def confirming(self, trials: Sequence[TrialRecord]) -> None:
        if self.bar.total is not None and self.bar.n < self.bar.total:
            self.bar.total = self.bar.n  # the search measured fewer than its cap: the measuring is done
            self.bar.refresh()
        # The rounds draw the line from their first step on (``rounds``); what an earlier phase left on it goes now.
        self.bar.set_postfix_str("", refresh=False)
        self.bar.set_description_str("lightning_ckpt: confirming", refresh=False)
        self.write(
            f"lightning_ckpt: confirming {count(len(trials), 'leading plan')} side by side in interleaved rounds; their "
            "samples/s will replace the figures streamed so far, which were timed one plan at a time."
        )

    def rounds(
        self, phase: str, round_number: int, max_rounds: int, timed: int, to_time: int, leader: str | None
    ) -> None:
        """Move the line during side-by-side rounds (``phase``: confirming, re-ranking, fresh rounds), every plan timed:
        rounds done (the clock restarted per phase), this round and the leader's interval."""
        status = f"round {round_number} of at most {max_rounds}: {timed}/{to_time} plans timed"
        status += f"; leader {leader}" if leader else ""
        if self._phase != phase:  # a new phase: its own clock and count, drawn once set (``reset`` redraws)
            self._phase = phase
            self.bar.unit = "round"
            self.bar.set_description_str(f"lightning_ckpt: {phase}", refresh=False)
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.reset(total=None)
            return
        self.bar.n = round_number - (timed < to_time)
        self.bar.set_postfix_str(status)

    def write(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text, file=self.bar.fp)
        else:
            print(text, flush=True)  # in order with the log lines on stderr when both go to one file

    def close(self) -> None:
        self.bar.close()
