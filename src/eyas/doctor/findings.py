"""Doctor findings: the registry of stable ids and the `Finding` record every check emits.

Ids never change meaning once released; a check that needs a new meaning gets a new id.
Each registry entry gives the default severity and a one-line title; the finding itself
carries the evidence (numbers), the cause in one sentence and the fix (a command when one
exists).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)

# id -> (default severity, title)
REGISTRY: dict[str, tuple[str, str]] = {
    "EYAS-LAYOUT-UNKNOWN": (ERROR, "checkpoint layout not recognised"),
    "EYAS-LAYOUT": (INFO, "checkpoint layout detected"),
    "EYAS-KEYS-MISSING": (ERROR, "engine would leave required weights at random init"),
    "EYAS-KEYS-SKIPPED": (ERROR, "engine would silently skip weights in the file"),
    "EYAS-ENGINE-REFUSES": (ERROR, "engine would refuse to load the checkpoint"),
    "EYAS-SHAPE-MISMATCH": (ERROR, "tensor shape disagrees with the architecture"),
    "EYAS-CONFIG-MISMATCH": (ERROR, "config.json disagrees with the weights"),
    "EYAS-CONFIG-MISSING": (WARNING, "config field an engine needs is absent"),
    "EYAS-D2T-MISSING": (ERROR, "no d2t: the draft vocabulary is read as the first N target ids"),
    "EYAS-D2T-ABSOLUTE": (ERROR, "d2t holds absolute target ids instead of offsets"),
    "EYAS-D2T-INVALID": (ERROR, "d2t maps draft ids to invalid or repeated target ids"),
    "EYAS-D2T-UNSORTED": (INFO, "d2t lists its target ids out of ascending order (served as is; eyas sorts it)"),
    "EYAS-D2T-ZERO": (WARNING, "d2t is all zeros: the draft vocabulary is the first N target ids"),
    "EYAS-T2D-MISMATCH": (ERROR, "t2d is inconsistent with d2t"),
    "EYAS-D2T-WRONG-IDS": (ERROR, "d2t maps draft ids to other target ids than the head was trained for"),
    "EYAS-HEAD-VOCAB-MISMATCH": (ERROR, "the lm_head and the vocabulary maps come from different vocabularies"),
    "EYAS-VOCAB-CHANGED": (ERROR, "the vocabulary maps are not the ones recorded at training"),
    "EYAS-HEAD-MATCH": (INFO, "which vocabulary map the lm_head was trained with"),
    "EYAS-POSITIONS-SHORT": (ERROR, "the drafter's positions are shorter than the context it is served at"),
    "EYAS-INCONCLUSIVE": (INFO, "a measured difference is within noise for the positions counted"),
    "EYAS-NONFINITE": (ERROR, "NaN or Inf in weights"),
    "EYAS-LMHEAD-UNTRAINED": (ERROR, "lm_head looks like it is still at initialisation"),
    "EYAS-WEIGHTS-UNTRAINED": (WARNING, "decoder weights look like they are still at initialisation"),
    "EYAS-EMBED-RANDOM": (ERROR, "shipped embed_tokens is random / not the target's"),
    "EYAS-DTYPE": (INFO, "weight dtypes"),
    "EYAS-AUX-IDS-MISSING": (ERROR, "no aux layer ids where the engine reads them"),
    "EYAS-AUX-IDS-OUT-OF-RANGE": (ERROR, "aux layer ids do not exist in the target"),
    "EYAS-AUX-VERSION-DEPENDENT": (WARNING, "aux ids mean different layers in different SGLang versions"),
    "EYAS-AUX-CONVENTION": (ERROR, "engines read the aux ids as different layers"),
    "EYAS-AUX-DISABLED": (ERROR, "engine would not capture aux hidden states"),
    "EYAS-FC-BYPASS": (ERROR, "fc would be skipped: the drafter gets an H-wide state"),
    "EYAS-AUX-OFF-BY-ONE": (ERROR, "aux ids are off by one for this engine"),
    "EYAS-ARCH-UNSUPPORTED": (WARNING, "engine has no aux capture for this target architecture"),
    "EYAS-ARCH-SUPPORTED": (INFO, "engine captures aux states for this target architecture"),
    "EYAS-VOCAB-MISMATCH": (ERROR, "draft vocabulary differs from the reference one"),
    "EYAS-VOCAB-SIZE": (ERROR, "vocabulary or hidden size differs from the target"),
    "EYAS-VOCAB-COVERAGE": (INFO, "share of supervised data tokens the draft vocabulary holds"),
    "EYAS-ACCEPTANCE-LOW": (ERROR, "measured acceptance is near chance"),
    "EYAS-ENGINE-DIVERGES": (ERROR, "an engine's reading loses acceptance against the eyas reference"),
    "EYAS-ACCEPTANCE": (INFO, "measured step-0 accuracy and predicted acceptance"),
    "EYAS-RECOMMEND": (INFO, "recommended engine flags"),
}


@dataclass
class Finding:
    """One result of one check."""

    id: str
    severity: str
    message: str  # what was found, one line
    evidence: dict = field(default_factory=dict)  # the numbers
    cause: str = ""  # one sentence
    fix: str = ""  # a command where one exists
    engine: str | None = None  # None: applies to every engine
    # the fix as `eyas` argv when it is one command writing a repaired checkpoint to the placeholder "OUT"
    command: list[str] | None = None

    def __post_init__(self) -> None:
        assert self.id in REGISTRY, f"unregistered finding id {self.id}"
        assert self.severity in SEVERITIES, self.severity

    def to_dict(self) -> dict:
        d = asdict(self)
        d["title"] = REGISTRY[self.id][1]
        return d


def make(fid: str, message: str, *, severity: str | None = None, **kw) -> Finding:
    """A finding with the registry's default severity unless one is given."""
    return Finding(fid, severity or REGISTRY[fid][0], message, **kw)


@dataclass
class Report:
    """Everything `eyas doctor` found and measured."""

    checkpoint: str
    layout: str | None = None
    findings: list[Finding] = field(default_factory=list)
    measurements: dict = field(default_factory=dict)

    def add(self, f: Finding | None) -> None:
        if f is not None:
            self.findings.append(f)

    def extend(self, fs) -> None:
        for f in fs:
            self.add(f)

    def ids(self, severity: str | None = None) -> list[str]:
        return [f.id for f in self.findings if severity is None or f.severity == severity]

    def has(self, fid: str, engine: str | None = "*") -> bool:
        return any(f.id == fid and (engine == "*" or f.engine == engine) for f in self.findings)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    def to_dict(self) -> dict:
        counts = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        return {"checkpoint": self.checkpoint, "layout": self.layout, "ok": not self.errors,
                "counts": counts, "findings": [f.to_dict() for f in self.findings],
                "measurements": self.measurements}

    def human(self) -> str:
        """Readable at a glance: one line per finding, errors first; under errors and warnings a
        short evidence line, the cause and the fix. Infos are one line; `--json` has everything."""
        order = {ERROR: 0, WARNING: 1, INFO: 2}
        lines = [f"eyas doctor: {self.checkpoint} (layout: {self.layout or '?'})"]
        for f in sorted(self.findings, key=lambda f: order[f.severity]):
            where = f" [{f.engine}]" if f.engine else ""
            lines.append(f"{f.severity.upper():7s} {f.id}{where}: {f.message}")
            if f.severity == INFO:
                continue
            ev = evidence_line(f.evidence)
            if ev:
                lines.append(f"        evidence: {ev}")
            if f.cause:
                lines.append(f"        cause: {f.cause}")
            if f.fix:
                lines.append(f"        fix: {f.fix}")
        c = self.to_dict()["counts"]
        lines.append(f"{c['error']} error(s), {c['warning']} warning(s), {c['info']} info")
        return "\n".join(lines)


def evidence_line(ev: dict, width: int = 110) -> str:
    """The scalar and short-list entries of an evidence record, cut to `width` characters
    (nested records and long lists stay in --json)."""
    parts = []
    for k, v in ev.items():
        if isinstance(v, float):
            parts.append(f"{k}={v:.3g}")
        elif isinstance(v, (int, str, bool)) and len(str(v)) <= 40:
            parts.append(f"{k}={v}")
        elif isinstance(v, (list, tuple)) and len(v) <= 6 and all(isinstance(x, (int, float, str)) for x in v):
            parts.append(f"{k}={list(v)}")
    line = ", ".join(parts)
    return line if len(line) <= width else line[:width - 3].rsplit(", ", 1)[0] + ", ..."
