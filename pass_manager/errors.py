"""Typed errors raised by the pass manager.

Every error derives from :class:`PassManagerError`, names the pass and its place in the plan
where one is involved, and carries what a caller needs to act on as attributes. What the
manager learns while rolling a pass back is set on the error (``diff``, ``unrestored``) and
rendered into its message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

__all__ = [
    "ArchiveError",
    "EffectsError",
    "InstrumentError",
    "PassFailedError",
    "PassManagerError",
    "PipelineElementError",
    "PipelineError",
    "PostconditionError",
    "PreconditionError",
    "ProgramFormError",
    "SemanticsError",
    "UntrustedFileError",
    "ValidationInputError",
]


def _where(pass_name: str, index: int | None) -> str:
    return f"pass #{index} {pass_name}" if index is not None else f"pass {pass_name}"


def _rebuilt(cls: type, args: tuple, attributes: dict) -> BaseException:
    """An error unpickled (or copied): its message and attributes as they were, without
    calling its constructor, whose parameters are not its message."""
    rebuilt = cls.__new__(cls, *args)
    rebuilt.args = args
    rebuilt.__dict__.update(attributes)
    return rebuilt


class PassManagerError(Exception):
    """Base class of every error the pass manager raises.

    Attributes:
        pass_name, index: the pass at fault and its place in the plan (None if none).
        rolled_back: the manager restored the program to its state before the pass.
        diff: a unified diff of what the pass had changed before the rollback ("" if none).
        unrestored: tensors the pass wrote in place whose old data was not kept.
        report: the run's :class:`Report` up to the failed pass (its record has ``error``
            and the statistics the error carried), or None.
        reproducer: the folder a Reproducer instrument wrote for this failure, or None.
        within: the passes it failed inside, innermost first, as ``(pass_name, index)``: a
            pass (or group) that ran a pipeline of its own in which ``pass_name`` failed.
    """

    def __init__(self, message: str, *, pass_name: str | None = None, index: int | None = None):
        super().__init__(message)
        self.pass_name = pass_name
        self.index = index
        self.rolled_back = False
        self.diff = ""
        self.unrestored: list[str] = []
        self.report: Any = None
        self.reproducer: Any = None
        self.within: list[tuple[str, int | None]] = []

    def __reduce__(self) -> tuple:
        # Python rebuilds an exception by calling its class with its message, which our
        # constructors (taking what the message is made of) refuse: a process pool, copy.
        return _rebuilt, (type(self), self.args, self.__dict__)

    def __str__(self) -> str:
        text = super().__str__()
        if self.within:
            text += "\nIt failed inside " + ", inside ".join(_where(*w) for w in self.within)
        if self.diff:
            text += f"\nThe pass was rolled back; it had changed:\n{self.diff}"
        elif self.rolled_back and isinstance(self, PassFailedError):
            text += ("\nThe pass was rolled back; the graph as printed had not changed (node "
                     "meta and tensor data are not printed).")
        if self.unrestored:
            text += ("\nNot restored: tensors written in place by the pass (their old values "
                     f"were not kept): {', '.join(self.unrestored)}")
        if self.reproducer is not None:
            text += (f"\nReproducer: {self.reproducer} (python -m pass_manager replay FOLDER; "
                     "its manifest.json says whether that needs --trust)")
        return text


class PipelineError(PassManagerError):
    """The pipeline cannot be planned: a dependency cycle (``cycle``), an unsatisfiable
    placement, two conditions sharing one name (``condition``), or text that does not parse."""

    def __init__(self, message: str, *, cycle: Sequence[str] = (), condition: str | None = None):
        super().__init__(message)
        self.cycle = list(cycle)
        self.condition = condition


class PipelineElementError(PipelineError, TypeError):
    """Something given to a PassManager is not what its place takes, found when the manager
    is built (a TypeError too, like a call with the wrong arguments): ``element`` (its
    repr), ``role`` (``"pass"`` or ``"instrument"``) and ``needs`` (what it must provide)."""

    def __init__(self, element: Any, role: str, needs: str, message: str | None = None):
        self.element = element if isinstance(element, str) else repr(element)
        self.role = role
        self.needs = needs
        super().__init__(message or f"{role} {self.element} is not a {role}: {needs}")


class _ConditionError(PassManagerError):
    kind = "condition"

    def __init__(self, pass_name: str, index: int | None, condition: str,
                 violations: Sequence[str], *, hint: str = ""):
        self.condition = condition
        self.violations = list(violations)
        self.hint = hint
        listing = [f"  - {v}" for v in self.violations[:20]]
        if len(self.violations) > 20:
            listing.append(f"  ... and {len(self.violations) - 20} more")
        message = (f"{_where(pass_name, index)}: {self.kind} {condition!r} does not hold "
                   f"({len(self.violations)} violation(s)):\n" + "\n".join(listing))
        super().__init__(message + (f"\n{hint}" if hint else ""), pass_name=pass_name,
                         index=index)


class PreconditionError(_ConditionError):
    """A pass's required condition does not hold on the program it is about to run on."""

    kind = "required condition"


class ProgramFormError(PreconditionError):
    """A pass was given a program form it does not accept: ``got`` (type name), ``accepted``
    (the forms it takes), ``advice`` (how to get one; "" if nothing to say)."""

    def __init__(self, pass_name: str, index: int | None, got: str, accepted: Sequence[str],
                 advice: str = ""):
        article = "an" if got[:1].lower() in "aeiou" else "a"
        violation = f"got {article} {got}; this pass accepts {' or '.join(accepted)}"
        super().__init__(pass_name, index, "program form",
                         [violation + (f": {advice}" if advice else "")])
        self.got = got
        self.accepted = list(accepted)
        self.advice = advice


class PostconditionError(_ConditionError):
    """A pass ran but did not establish a condition it promises to provide."""

    kind = "provided condition"


class PassFailedError(PassManagerError):
    """A pass raised (or broke its contract); the program was rolled back to its state before it."""

    def __init__(self, pass_name: str, index: int | None, reason: str):
        self.reason = reason
        super().__init__(f"{_where(pass_name, index)} failed: {reason}", pass_name=pass_name,
                         index=index)


class InstrumentError(PassManagerError):
    """An instrument's hook raised (the instrument failed, not the pass): ``instrument``
    (its class name), ``hook``, ``reason``; ``pass_name`` is the pass it was around (None for
    ``before_run`` / ``after_run``). Around a pass, the pass is rolled back."""

    def __init__(self, instrument: str, hook: str, pass_name: str | None, index: int | None,
                 reason: str):
        self.instrument, self.hook, self.reason = instrument, hook, reason
        around = f" around {_where(pass_name, index)}" if pass_name else ""
        super().__init__(f"instrument {instrument}.{hook}{around} raised {reason} (the "
                         "instrument failed, not the pass)", pass_name=pass_name, index=index)


class EffectsError(PassFailedError):
    """A pass changed what its ``effects`` (:class:`~pass_manager.Effects`) say it does not.

    ``kind`` is the declaration it broke: ``"in_place"`` (returned another program object,
    or changed the one given while declaring a new one), ``"writes_state"`` (wrote tensor
    data in place; also in ``unrestored``), ``"edits_meta_in_place"`` (edited a node-meta
    object in place; under ``strict=True``) or ``"meta_keys"`` (changed more than the meta
    keys it declares). ``edits`` lists what it changed ([] for in_place).
    """

    _REASONS: ClassVar[dict[str, str]] = {
        "writes_state": "wrote tensor data in place without declaring writes_state = True "
                        "in its effects: {}",
        "edits_meta_in_place": "edited meta objects in place while its effects declare "
                               "edits_meta_in_place = False (replace them instead: "
                               "node.meta[key] = new): {}",
        "meta_keys": "changed more than the node meta keys its effects declare (meta_keys): {}",
    }

    def __init__(self, pass_name: str, index: int | None, kind: str,
                 edits: Sequence[str] = (), reason: str = ""):
        separator = "; " if kind == "meta_keys" else ", "
        super().__init__(pass_name, index,
                         reason or self._REASONS[kind].format(separator.join(edits)))
        self.kind = kind
        self.edits = list(edits)


class SemanticsError(PassManagerError):
    """After a pass, the program computes something else than before the pipeline
    (``difference`` says what)."""

    def __init__(self, pass_name: str, index: int | None, difference: str):
        self.difference = difference
        super().__init__(f"{_where(pass_name, index)} changed what the program computes: "
                         f"{difference}", pass_name=pass_name, index=index)


class ArchiveError(PassManagerError):
    """A file cannot be read as what this library saved there (a program, a reproducer's
    validation data or manifest): damaged, or written by something else. ``path`` names
    it, ``reason`` says what is wrong."""

    def __init__(self, path: Any, reason: str, message: str | None = None):
        self.path = path
        self.reason = reason
        super().__init__(message or f"{path}: cannot be read: {reason}")


class UntrustedFileError(ArchiveError):
    """Reading a file (or importing a module a reproducer names) would run code from it,
    and the caller did not say it trusts the file: ``path``, ``format`` (how it is stored),
    ``reason`` (what would run)."""

    def __init__(self, path: Any, format: str, reason: str):
        self.format = format
        super().__init__(
            path, reason,
            f"{path} ({format}) was not read: {reason}. Reading it could run code chosen by "
            "whoever made it, so it is read only when you trust its source: pass "
            "trusted=True to load_program / load_reproducer / replay, or --trust to "
            "python -m pass_manager replay",
        )


class ValidationInputError(PassManagerError, TypeError):
    """Inputs given to check what a program computes do not fit it (a TypeError too, like
    a call with the wrong arguments), found before any pass runs.

    Attributes:
        option: where the inputs came from, e.g. ``"SemanticValidation(inputs=...)"``.
        call: which inputs, e.g. ``"inputs[1]"`` (None: the option as a whole).
        reason: what is wrong.
        expected, given: the inputs the program takes and those given ("" if not known).
    """

    def __init__(self, option: str, call: str | None, reason: str, *, expected: str = "",
                 given: str = ""):
        self.option = option
        self.call = call
        self.reason = reason
        self.expected = expected
        self.given = given
        what = f"{call} does not fit the program" if call else "bad inputs"
        message = f"{option}: {what}: {reason}"
        if expected:
            message += f"\n  the program takes: {expected}"
        if given:
            message += f"\n  {call or option} gives: {given}"
        super().__init__(message)
