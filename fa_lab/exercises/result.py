"""What ``check`` returns: a score, a row per case, and a table that shows in a notebook.

Scoring: one point per case for the values, plus one point per structure check that
applies to the case.  The rows are planned before anything runs, so ``max_score`` is the
same for a stub, a wrong answer and the solution (a gradebook can rely on it).
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from fa_lab.exercises.feedback import Mismatch, heatmap_png

_MARK = {True: "✓", False: "✗", None: "·"}   # passed, failed, not run


@dataclass
class CheckResult:
    """What ``check`` returns: ``.passed``, ``.score``, ``.max_score`` and a row per case (and structure check).

    A row is a dict: ``case`` (label with the seed), ``group`` (the label without it), ``seed``,
    ``kind`` ('values', 'structure' or 'skipped'), ``passed``, ``message`` (and for a wrong answer
    ``details``, a ``Mismatch``, and ``diagnosis``).  It shows as a table with one line per case
    and one column per seed; the first failing case is spelled out above it, with a heatmap.
    """

    name: str
    title: str
    rows: list = field(default_factory=list)
    hint: str = ""
    seconds: float = 0.0
    interrupted: bool = False    # the user stopped the check: the rows not run count as failed
    output: str = ""             # what the learner's code printed while it was checked (shown below the table)

    @property
    def score(self) -> int:
        return sum(bool(r["passed"]) for r in self.rows)

    @property
    def max_score(self) -> int:
        return len(self.rows)

    @property
    def passed(self) -> bool:
        return self.max_score > 0 and self.score == self.max_score

    @property
    def first_failure(self):
        return next((r for r in self.rows if not r["passed"]), None)

    def summary(self) -> str:
        tail = " (interrupted)" if self.interrupted else ""
        return f"{self.name}: {self.score}/{self.max_score} {'PASSED' if self.passed else 'not yet'}{tail}"

    def to_dict(self) -> dict:
        first = self.first_failure
        return dict(name=self.name, title=self.title, score=self.score, max_score=self.max_score,
                    passed=self.passed, seconds=round(self.seconds, 3), interrupted=self.interrupted,
                    first_failure=None if first is None else dict(case=first["case"], message=first["message"],
                                                                  diagnosis=first.get("diagnosis", "")),
                    rows=[dict(case=r["case"], kind=r["kind"], passed=bool(r["passed"]), message=r["message"])
                          for r in self.rows])

    def _feedback_lines(self, r) -> list[str]:
        lines = [r["message"]]
        if r.get("diagnosis"):
            lines.append(f"Diagnosis: {r['diagnosis']}")
        if self.hint:
            lines.append(f"Hint: {self.hint}")
        return lines

    def _table(self):
        """(seeds, [(group, {seed: row}, first failing row or None)]) in the order the cases ran."""
        seeds, groups = [], {}
        for r in self.rows:
            seed = r.get("seed")
            if seed not in seeds:
                seeds.append(seed)
            groups.setdefault(r.get("group", r["case"]), {})[seed] = r
        table = []
        for by_seed in groups.values():
            failing = next((r for r in by_seed.values() if not r["passed"] and r["kind"] != "skipped"), None)
            shown = failing or next(iter(by_seed.values()))      # its label (shapes may differ by seed)
            table.append((shown.get("label", shown["case"]), by_seed, failing))
        return seeds, table

    @staticmethod
    def _state(row):
        return None if row is None or row["kind"] == "skipped" else bool(row["passed"])

    def __repr__(self) -> str:
        lines = [f"{self.summary()} — {self.title}"]
        first = self.first_failure
        if first is not None:
            lines.append(f"First failing case: {first['case']}")
            lines += [f"  {line}" for line in self._feedback_lines(first)]
        seeds, table = self._table()
        head = " ".join(f"s{s}" if s is not None else "  " for s in seeds)
        lines.append(f"  {head}  case")
        for group, by_seed, failing in table:
            marks = " ".join(f"{_MARK[self._state(by_seed.get(s))]:>2}" for s in seeds)
            lines.append(f"  {marks}  {group}" + (f" — {_brief(failing)}" if failing else ""))
        skipped = [r for r in self.rows if r["kind"] == "skipped"]
        if skipped:
            lines.append(f"  ({len(skipped)} row(s) {skipped[0]['message']})")
        if self.output:
            lines.append("Your code printed:")
            lines += [f"  {line}" for line in self._printed().splitlines()]
        return "\n".join(lines)

    def _printed(self, limit: int = 4000) -> str:
        text = self.output.rstrip()
        return text if len(text) <= limit else text[:limit] + f"\n… ({len(text) - limit} more characters)"

    def _repr_html_(self) -> str:
        esc = html.escape
        color = "#1a7f37" if self.passed else "#cf222e"
        out = [f"<div class='fa-lab-check'><p><b style='color:{color}'>{esc(self.title)}: "
               f"{self.score}/{self.max_score} {'passed' if self.passed else 'not yet'}"
               f"{' (interrupted)' if self.interrupted else ''}</b> "
               f"<code style='color:#57606a'>{esc(self.name)}</code></p>"]
        first = self.first_failure
        if first is not None:
            out.append("<div style='border-left:3px solid #cf222e;padding-left:8px;margin-bottom:6px'>"
                       f"<b>First failing case:</b> <code>{esc(first['case'])}</code><br>")
            out.append("<br>".join(esc(line) for line in self._feedback_lines(first)))
            png = self._heatmap(first)
            if png:
                out.append(f"<br><img alt='expected vs got' src='data:image/png;base64,{png}'/>")
            out.append("</div>")
        seeds, table = self._table()
        cell = {True: "<td style='color:#1a7f37;text-align:center' title='passed'>✓</td>",
                None: "<td style='color:#8c959f;text-align:center' title='not run'>·</td>"}
        out.append("<table><tr>" + "".join(f"<th>seed&nbsp;{s}</th>" if s is not None else "<th></th>" for s in seeds)
                   + "<th style='text-align:left'>case</th><th style='text-align:left'>feedback</th></tr>")
        for group, by_seed, failing in table:
            tds = []
            for s in seeds:
                r = by_seed.get(s)
                state = self._state(r)
                tds.append(cell[state] if state is not False else
                           f"<td style='color:#cf222e;text-align:center' title='{esc(r['message'])}'>✗</td>")
            out.append("<tr>" + "".join(tds) + f"<td style='text-align:left'><code>{esc(group)}</code></td>"
                       f"<td style='text-align:left'>{esc(_brief(failing)) if failing else ''}</td></tr>")
        out.append("</table>")
        skipped = [r for r in self.rows if r["kind"] == "skipped"]
        if skipped:
            out.append(f"<p style='color:#57606a'>{len(skipped)} row(s) {esc(skipped[0]['message'])}</p>")
        if self.output:
            out.append(f"<details><summary>Your code printed</summary><pre>{esc(self._printed())}</pre></details>")
        out.append("</div>")
        return "".join(out)

    @staticmethod
    def _heatmap(row) -> str | None:
        details = row.get("details")
        if not isinstance(details, Mismatch):
            return None
        if "png" not in row:
            try:
                row["png"] = heatmap_png(details, title=f"{details.what} — {row['case']}")
            except Exception:  # a picture must never break the feedback
                row["png"] = None
        return row["png"]


def _brief(row, n: int = 140) -> str:
    """One line for the table: a wrong answer's summary, else the message, shortened."""
    details = row.get("details")
    msg = f"wrong answer: {details.summary}" if isinstance(details, Mismatch) and details.summary else row["message"]
    return msg if len(msg) <= n else msg[: n - 1] + "…"
