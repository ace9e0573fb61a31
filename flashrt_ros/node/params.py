"""Node parameters: one table per node, from which everything else is derived.

Each `Param` is declared once (name, default, type, range or choices, help, live or not). From a
`ParamTable` come the ROS declaration (descriptors with type, ranges and read_only), the checks
(the same for `--params-file`, `-p` and `ros2 param set`), the frozen config dataclass, `--help`
and config/flashrt.yaml (`python -m flashrt_ros.node.params --yaml`). The sim arm uses the same
mechanism for its own table.

Importing this module needs no ROS (tools and the demo take DEFAULT_JOINTS from here); rclpy is
imported by the functions that talk to a node.
"""

from __future__ import annotations

import array
import dataclasses
import difflib
import fnmatch
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from flashrt_ros.errors import BadRequest
from flashrt_ros.obs.images import CAMERA_RE
from flashrt_ros.obs.joints import DEFAULT_FIELDS, FIELDS

DEFAULT_JOINTS = [f"joint{i}" for i in range(1, 7)]

KINDS = ("string", "integer", "double", "bool", "string_array", "double_array")
_PYTYPES = {
    "string": str,
    "integer": int,
    "double": float,
    "bool": bool,
    "string_array": tuple[str, ...],
    "double_array": tuple[float, ...],
}
# declared by rclpy itself on every node; never "unknown"
_RCLPY_OWN = ("use_sim_time", "start_type_description_service", "qos_overrides.*")
# rcl options that take an argument (so their argument is never read as a -p rule)
_ROS_ARG_OPTIONS = {
    "-r",
    "--remap",
    "-p",
    "--param",
    "--params-file",
    "--log-level",
    "--log-config-file",
    "--log-file-name",
    "-e",
    "--enclave",
}


class ParamError(BadRequest):
    """One or more bad parameters; each line names one and says what it accepts."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter. `lo`/`hi` bound numbers (inclusive); `pattern` must match each string
    (or array item) in full, `pattern_text` says so in words; `live` parameters may be set at
    run time (validated, applied at once), the others are read-only: they need a reconfigure."""

    name: str
    default: Any
    kind: str
    help: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    pattern: str | None = None
    pattern_text: str = ""
    unique: bool = False
    min_items: int = 0
    live: bool = False
    # a string parameter that may be given as a bare number (rcl reads `cpu_affinity: 3` as
    # the integer 3): a non-negative integer is taken as its decimal text
    int_as_text: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind in ("integer", "double") and (self.lo is None or self.hi is None):
            raise ValueError(f"{self.name}: a number needs a range (lo and hi)")
        self.convert(self.default)  # a default must pass its own checks

    @property
    def pytype(self) -> type:
        return _PYTYPES[self.kind]

    def accepts(self) -> str:
        """What the parameter accepts, in words (for errors, --help and descriptors)."""
        k = self.kind
        if k == "bool":
            return "true or false"
        if k == "integer":
            return f"an integer in [{_num(self.lo)}, {_num(self.hi)}]"
        if k == "double":
            return f"a finite number in [{_num(self.lo)}, {_num(self.hi)}]"
        if k == "string":
            if self.choices:
                return "one of " + ", ".join(repr(c) for c in self.choices)
            return self.pattern_text or "a string"
        what = "names" if k == "string_array" else "finite numbers"
        if k == "string_array" and self.pattern_text:
            what = f"names ({self.pattern_text})"
        text = f"a {'non-empty ' if self.min_items else ''}list of {what}"
        if self.unique:
            text += ", each at most once"
        return text

    def convert(self, value: Any) -> Any:
        """The value in its config type (ints taken for doubles, arrays as tuples), or
        ParamError naming the parameter, the value and what it accepts."""
        try:
            return self._convert(value)
        except _Bad as e:
            why = f" ({e.args[0]})" if e.args and e.args[0] else ""
            raise ParamError(
                [f"parameter {self.name}={_show(value)}{why}; accepts {self.accepts()}"]
            ) from None

    def _convert(self, v: Any) -> Any:
        k = self.kind
        if k == "bool":
            if not isinstance(v, bool):
                raise _Bad(_kind_of(v))
            return v
        if k in ("integer", "double"):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _Bad(_kind_of(v))
            if k == "integer" and not isinstance(v, int):
                raise _Bad("not an integer")
            if not math.isfinite(v):
                raise _Bad("not finite")
            if not self.lo <= v <= self.hi:
                raise _Bad("out of range")
            return int(v) if k == "integer" else float(v)
        if k == "string":
            if self.int_as_text and type(v) is int and v >= 0:
                v = str(v)
            if not isinstance(v, str):
                raise _Bad(_kind_of(v))
            if self.choices and v not in self.choices:
                raise _Bad("")
            if self.pattern is not None and not re.fullmatch(self.pattern, v):
                raise _Bad("")
            return v
        if v is None:  # rcl reads an empty YAML sequence as "not set"
            v = []
        if not isinstance(v, (list, tuple, array.array)):
            raise _Bad("not a list")
        items = list(v)
        if len(items) < self.min_items:
            raise _Bad("empty" if not items else "too few items")
        if k == "string_array":
            if not all(isinstance(x, str) and x for x in items):
                raise _Bad("every item must be a non-empty string")
            if self.pattern is not None:
                bad = [x for x in items if not re.fullmatch(self.pattern, x)]
                if bad:
                    raise _Bad(f"{bad[0]!r} does not match")
        else:
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
                raise _Bad("every item must be a number")
            items = [float(x) for x in items]
            if not all(math.isfinite(x) for x in items):
                raise _Bad("not finite")
        if self.unique and len(set(items)) != len(items):
            dup = next(x for i, x in enumerate(items) if x in items[:i])
            raise _Bad(f"{dup!r} appears twice")
        return tuple(items)

    def yaml_value(self) -> str:
        d = self.default
        if self.kind == "bool":
            return "true" if d else "false"
        if self.kind == "double":
            return repr(float(d))
        if self.kind in ("string_array", "double_array"):
            return json.dumps(list(d))
        return json.dumps(d)

    def descriptor(self, read_only: bool | None = None) -> Any:
        """The rcl_interfaces ParameterDescriptor of this parameter."""
        from rcl_interfaces.msg import (
            FloatingPointRange,
            IntegerRange,
            ParameterDescriptor,
            ParameterType,
        )

        types = {
            "string": ParameterType.PARAMETER_STRING,
            "integer": ParameterType.PARAMETER_INTEGER,
            "double": ParameterType.PARAMETER_DOUBLE,
            "bool": ParameterType.PARAMETER_BOOL,
            "string_array": ParameterType.PARAMETER_STRING_ARRAY,
            "double_array": ParameterType.PARAMETER_DOUBLE_ARRAY,
        }
        d = ParameterDescriptor(
            name=self.name,
            type=types[self.kind],
            description=self.help,
            additional_constraints=f"accepts {self.accepts()}",
            read_only=(not self.live) if read_only is None else read_only,
        )
        if self.kind == "integer":
            d.integer_range = [IntegerRange(from_value=int(self.lo), to_value=int(self.hi), step=1)]
        elif self.kind == "double":
            d.floating_point_range = [
                FloatingPointRange(from_value=float(self.lo), to_value=float(self.hi), step=0.0)
            ]
        return d


class _Bad(Exception):
    pass


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _kind_of(v: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    return names.get(type(v), "a list" if isinstance(v, (list, tuple)) else type(v).__name__)


def _show(v: Any) -> str:
    if v is None:  # rcl's empty list
        return "[]"
    return repr(v.tolist() if hasattr(v, "tolist") else v)


class ParamTable:
    """A node's parameters, in declaration order, and what is derived from them."""

    def __init__(
        self,
        params: Sequence[Param],
        config_name: str,
        cross: Callable[[Mapping[str, Any]], list[str]] | None = None,
    ):
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in {names}")
        self.params = {p.name: p for p in params}
        self.cross = cross
        # the config type: one field per parameter, so there is no second list to keep in sync
        self.Config = dataclasses.make_dataclass(
            config_name, [(p.name, p.pytype) for p in params], frozen=True
        )
        self.Config.__doc__ = "Checked parameter values; frozen, replaced whole on a live set."
        self.config(self.defaults())  # the defaults must pass the cross checks too

    def __iter__(self) -> Iterator[Param]:
        return iter(self.params.values())

    def __getitem__(self, name: str) -> Param:
        return self.params[name]

    @property
    def names(self) -> list[str]:
        return list(self.params)

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self}

    def config(self, values: Mapping[str, Any]) -> Any:
        """Check every value (and the cross rules); ParamError lists every bad one."""
        problems: list[str] = []
        out: dict[str, Any] = {}
        for p in self:
            try:
                out[p.name] = p.convert(values.get(p.name, p.default))
            except ParamError as e:
                problems += e.problems
        if not problems and self.cross is not None:
            problems += self.cross(out)
        if problems:
            raise ParamError(problems)
        return self.Config(**out)

    # -- text ------------------------------------------------------------------------------------
    def help_text(self) -> str:
        """One entry per parameter: type, default, what it accepts, live or read-only, help."""
        lines = []
        for p in self:
            mode = "live: ros2 param set applies it" if p.live else "read-only"
            lines.append(f"  {p.name} ({p.kind}, default {p.yaml_value()}; {mode})")
            lines.append(f"      {p.help}")
            lines.append(f"      accepts {p.accepts()}")
        return "\n".join(lines)

    def markdown_table(self) -> str:
        """The README's parameter table, generated so it never drifts from the declaration."""
        rows = ["| name | default | accepts | live | meaning |", "|---|---|---|---|---|"]
        for p in self:
            cells = (f"`{p.name}`", p.yaml_value(), p.accepts(), "yes" if p.live else "no", p.help)
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return "\n".join(rows) + "\n"

    def yaml_text(self, header: str) -> str:
        """A params file with every default, each under its help (config/flashrt.yaml)."""
        out = [f"# {line}".rstrip() for line in header.splitlines()]
        out += ["/**:", "  ros__parameters:"]
        for p in self:
            mode = "live" if p.live else "read-only"
            text = f"{p.help} ({mode}; accepts {p.accepts()})"
            out += textwrap.wrap(
                text,
                99,
                initial_indent="    # ",
                subsequent_indent="    #   ",
                break_on_hyphens=False,
            )
            out.append(f"    {p.name}: {p.yaml_value()}")
        return "\n".join(out) + "\n"

    def hint(self, name: str, names: Sequence[str] | None = None) -> str:
        """' (did you mean X?)' for a misspelt parameter name close to one of `names` (default:
        this table's), else ''."""
        close = difflib.get_close_matches(name, self.names if names is None else names, n=1)
        return f" (did you mean {close[0]}?)" if close else ""

    def unknown_set(self, unknown: Sequence[str], declared: Sequence[str]) -> str:
        """Why a set of parameters the node does not have (`declared`: those it has) is
        refused: rclpy's own reason lists no name ("undeclared parameter(s): []")."""
        said = "; ".join(f"{n!r}{self.hint(n, declared)}" for n in unknown)
        return f"the node has no parameter {said}; parameters: {', '.join(self.names)}"

    # -- ROS -------------------------------------------------------------------------------------
    def check(self, node, argv: Sequence[str] | None = None) -> Any:
        """The config that `node`'s --params-file and -p overrides give, or ParamError listing
        every bad parameter. Declares nothing, so it may run on a throwaway node."""
        overrides = _overrides(node)
        values = {p.name: overrides.get(p.name, p.default) for p in self}
        problems: list[str] = []
        cfg = None
        try:
            cfg = self.config(values)
        except ParamError as e:
            problems += e.problems
        problems += self._dropped_cli(node, overrides, sys.argv if argv is None else argv)
        if problems:
            raise ParamError(list(dict.fromkeys(problems)))  # a -p rule may repeat a problem
        return cfg

    def declare(
        self,
        node,
        argv: Sequence[str] | None = None,
        on_change: Callable[[dict[str, Any]], None] | None = None,
    ) -> Any:
        """Check and declare every parameter; returns the config, or raises ParamError (before
        anything is declared) listing every bad one. `on_change(changes)` runs after a
        successful `ros2 param set` of live parameters (values in config types)."""
        from rclpy.parameter import Parameter

        cfg = self.check(node, argv)
        overrides = _overrides(node)
        for p in self:
            value = getattr(cfg, p.name)
            if p.kind in ("string_array", "double_array"):
                value = list(value)
            if value == [] and p.kind.endswith("_array"):
                # an empty list has no type of its own in rclpy: declare typed, then set it
                ptype = Parameter.Type.STRING_ARRAY
                if p.kind == "double_array":
                    ptype = Parameter.Type.DOUBLE_ARRAY
                node.declare_parameter(
                    p.name, ptype, p.descriptor(read_only=False), ignore_override=True
                )
                node.set_parameters([Parameter(p.name, ptype, [])])
                if not p.live:
                    node.set_descriptor(p.name, p.descriptor())
            else:
                node.declare_parameter(p.name, value, p.descriptor(), ignore_override=True)

        unknown = sorted(
            n
            for n in overrides
            if n not in self.params and not any(fnmatch.fnmatch(n, o) for o in _RCLPY_OWN)
        )
        for n in unknown:
            node.get_logger().warning(
                f"unknown parameter {n!r} ignored{self.hint(n)}; "
                f"parameters: {', '.join(self.names)}"
            )
        fqn = node.get_fully_qualified_name()
        for warning in unmatched_params_files(sys.argv if argv is None else argv, fqn):
            node.get_logger().warning(warning)

        node.add_pre_set_parameters_callback(self._coerce)
        node.add_on_set_parameters_callback(lambda ps: self._check_set(node, ps))
        if on_change is not None:
            node.add_post_set_parameters_callback(
                lambda ps: on_change(
                    {q.name: self[q.name].convert(q.value) for q in ps if q.name in self.params}
                )
            )
        return cfg

    def read(self, node) -> Any:
        """The node's current parameter values as a checked config."""
        return self.config({p.name: node.get_parameter(p.name).value for p in self})

    def _coerce(self, params: list) -> list:
        """`ros2 param set rate 5` sends an INTEGER: store it as the double that is declared."""
        from rclpy.parameter import Parameter

        out = []
        for q in params:
            p = self.params.get(q.name)
            if p is not None and p.kind == "double" and q.type_ == Parameter.Type.INTEGER:
                q = Parameter(q.name, Parameter.Type.DOUBLE, float(q.value))
            elif (
                p is not None
                and p.kind == "double_array"
                and q.type_ == Parameter.Type.INTEGER_ARRAY
            ):
                q = Parameter(q.name, Parameter.Type.DOUBLE_ARRAY, [float(x) for x in q.value])
            out.append(q)
        return out

    def type_refusal(self, params: list, reason: str) -> str:
        """A set rclpy refused for a value's type, said as a bad value is: rclpy's "Wrong
        parameter type, expected '3' got '4'" named neither the parameter nor what it accepts
        (a `ros2 param set` user sees only this reply)."""
        for q in params:
            p = self.params.get(q.name)
            if p is None:
                continue
            try:
                p.convert(q.value)
            except ParamError as e:
                return str(e)
        return reason

    def _check_set(self, node, params: list):
        """Refuse, with the reason, a set that would leave any parameter invalid."""
        from rcl_interfaces.msg import SetParametersResult

        values = {p.name: node.get_parameter(p.name).value for p in self}
        for q in params:
            if q.name in self.params:
                values[q.name] = q.value
        try:
            self.config(values)
        except ParamError as e:
            return SetParametersResult(successful=False, reason=str(e))
        return SetParametersResult(successful=True)

    def _dropped_cli(self, node, overrides: Mapping[str, Any], argv: Sequence[str]) -> list[str]:
        """`-p` rules that rcl dropped without a word, so the command line is read here too and
        any such rule is reported with its cause. rcl keeps the params file's value when a `-p`
        value has another type (`-p capsule_slots:=abc`, `-p joint_names:=[]`), and also when
        a params file has a section naming this node (`/left/flashrt:`): `-p` rules join the
        `/**` section, which a section naming the node overrides."""
        problems = []
        for name, (raw, value) in cli_overrides(argv, node.get_name()).items():
            p = self.params.get(name)
            if p is None:
                continue
            try:
                got = p.convert(value)
            except ParamError as e:
                problems += e.problems
                continue
            try:
                delivered = p.convert(overrides.get(name, p.default))
            except ParamError:
                continue  # reported by the check of the delivered values
            if got == delivered:
                continue
            if _rcl_type(value) != _rcl_type(overrides.get(name, p.default)):
                problems.append(
                    f"parameter {name}: -p {name}:={raw} was not applied by rcl (the params "
                    f"file's value {delivered!r} has another type); accepts {p.accepts()}"
                )
            else:
                problems.append(
                    f"parameter {name}: -p {name}:={raw} was not applied by rcl: a params file "
                    f"section naming this node sets {delivered!r}, and it takes precedence over "
                    "-p (whose rules join the `/**` section); set the value in that section, "
                    "or key that file `/**:`"
                )
        return problems


def _rcl_type(value: Any) -> tuple:
    """The parameter type rcl gives a value: a list's is its items' (none for an empty one)."""
    if isinstance(value, list | tuple | array.array):
        return ("array", type(value[0]) if len(value) else None)
    return (type(value),)


def _overrides(node) -> dict[str, Any]:
    """What rcl parsed from --params-file and -p for this node. rclpy offers no public
    accessor; the attribute has been there since Dashing."""
    return {n: q.value for n, q in getattr(node, "_parameter_overrides", {}).items()}


def checked_params_file(path: str) -> str:
    """The launch file's params_file, or FileNotFoundError: launch_ros only warns about a
    missing file and starts the node on its defaults (another policy, rate and joints than the
    robot's, from a typo in the path)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"params_file:={path}: no such file")
    if _params_yaml(path) is None:
        raise ValueError(
            f"params_file:={path} is empty (or only comments): the node would run on its defaults"
        )
    return path


_UNREADABLE = object()  # rcl reads such a file first and says what is wrong


def _params_yaml(path: str):
    """A params file's YAML document (None: empty or only comments), or _UNREADABLE."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return _UNREADABLE


def _section_matches(key: str, fqn: str) -> bool:
    """Whether a params file section applies to the node `fqn` (/ns/name), as rcl reads it:
    a key without a leading / is under /, `*` is one name, `**` any number of them."""
    key = key if key.startswith("/") else "/" + key
    pattern = re.escape(key).replace(r"/\*\*", "(/.*)?").replace(r"\*", "[^/]*")
    return re.fullmatch(pattern, fqn) is not None


def unmatched_params_files(argv: Sequence[str], fqn: str) -> list[str]:
    """A warning for each --params-file none of whose sections applies to the node `fqn`:
    rcl applies none of it and says nothing, so a file keyed `flashrt:` (which is /flashrt)
    for a node in a namespace left the node on its defaults, silently."""
    out = []
    for a, path in ros_arg_options(argv):
        if a == "--params-file":
            doc = _params_yaml(path)
            if doc is _UNREADABLE:
                continue
            if doc is None:  # empty or only comments: rcl takes it without a word
                out.append(
                    f"params file {path} is empty (or only comments), so the node runs on its "
                    "defaults: another policy, rate and joints than a robot's; was it cut short?"
                )
                continue
            keys = [str(k) for k in doc] if isinstance(doc, dict) else []
            if keys and not any(_section_matches(k, fqn) for k in keys):
                out.append(
                    f"params file {path}: no section applies to this node {fqn} (its sections: "
                    f"{', '.join(keys)}), so none of its values is used; key it /**: or {fqn}:"
                )
    return out


def wants_help(argv: Sequence[str]) -> bool:
    """-h or --help among the program's own arguments: those before --ros-args (after it, rcl's
    own rules apply), so `--help --ros-args -p ...` prints the help too, and starts nothing."""
    own = argv[1 : argv.index("--ros-args")] if "--ros-args" in argv else argv[1:]
    return any(a in ("-h", "--help") for a in own)


def cli_overrides(argv: Sequence[str], node_name: str) -> dict[str, tuple[str, Any]]:
    """`-p [node:]name:=value` rules of the --ros-args sections that apply to `node_name` and
    come after the last --params-file (a later file's `/**` values replace them; a section
    naming the node, in any file, wins over them): name -> (text, value)."""
    rules: dict[str, tuple[str, Any]] = {}
    for a, arg in ros_arg_options(argv):
        if a == "--params-file":
            rules.clear()
        elif a in ("-p", "--param") and ":=" in arg:
            lhs, raw = arg.split(":=", 1)
            target, _, name = lhs.rpartition(":")
            if not target or fnmatch.fnmatch(node_name, target.lstrip("/")):
                rules[name] = (raw, rcl_value(raw))
    return rules


def ros_arg_options(argv: Sequence[str]) -> Iterator[tuple[str, str]]:
    """(option, value) of each option that takes a value in the --ros-args sections of argv,
    in order (a section ends at `--`)."""
    in_ros, i = False, 0
    while i < len(argv):
        a = argv[i]
        if a == "--ros-args":
            in_ros = True
        elif a == "--" and in_ros:
            in_ros = False
        elif in_ros and a in _ROS_ARG_OPTIONS and i + 1 < len(argv):
            yield a, argv[i + 1]
            i += 1
        i += 1


_RCL_TRUE = {"Y", "y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"}
_RCL_FALSE = {"N", "n", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"}
_RCL_INT = re.compile(r"\s*[+-]?(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")
_RCL_FLOAT = re.compile(
    r"\s*[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE
)
_RCL_SPECIAL = {".nan": math.nan, ".inf": math.inf, "-.inf": -math.inf}


def rcl_scalar(text: str, quoted: bool) -> Any:
    """A YAML scalar as rcl types it (parse.c): YAML 1.1 booleans, C strtol/strtod numbers
    (0x10, 010, 1e-3, nan), anything else (and anything quoted) a string."""
    if quoted:
        return text
    if text in _RCL_TRUE or text in _RCL_FALSE:
        return text in _RCL_TRUE
    if _RCL_INT.fullmatch(text):
        t = text.strip()
        sign = -1 if t.startswith("-") else 1
        digits = t.lstrip("+-")
        base = 16 if digits[:2] in ("0x", "0X") else 8 if digits.startswith("0") else 10
        n = sign * int(digits, base)
        if -(1 << 63) <= n < (1 << 63):
            return n
    if text.lower() in _RCL_SPECIAL:
        return _RCL_SPECIAL[text.lower()]
    if _RCL_FLOAT.fullmatch(text):
        x = float(text)
        overflow = math.isinf(x) and "inf" not in text.lower()
        underflow = x == 0.0 and any(c in "123456789" for c in text.lower().split("e")[0])
        if not (overflow or underflow):
            return x
    return text


def rcl_value(raw: str) -> Any:
    """The value of a `-p name:=raw` rule as rcl reads it (an empty list: None, as rcl has it)."""
    import yaml

    try:
        node = yaml.compose(raw)
    except yaml.YAMLError:
        return raw
    if node is None:
        return raw
    if isinstance(node, yaml.SequenceNode):
        items = [
            rcl_scalar(n.value, n.style is not None)
            for n in node.value
            if isinstance(n, yaml.ScalarNode)
        ]
        return items or None
    if isinstance(node, yaml.ScalarNode):
        return rcl_scalar(node.value, node.style is not None)
    return raw


# -- the flashrt node --------------------------------------------------------------------------


CPU_LIST = r"(\d+(-\d+)?(,\d+(-\d+)?)*)?"  # taskset -c's list: "3", "2,3", "4-7,9", or ""
MAX_CPU = 8191  # Linux's largest CPU number (NR_CPUS at most 8192)


def parse_cpus(text: str) -> frozenset[int]:
    """The CPU numbers of a `cpu_affinity` list ("" = none); ValueError for a malformed list,
    a range that runs backwards ("5-2") or a CPU number no Linux has."""
    if not re.fullmatch(CPU_LIST, text):
        raise ValueError(f"{text!r} is not a CPU list such as '3', '2,3' or '4-7'")
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"the range {part!r} runs backwards")
        if b > MAX_CPU:
            raise ValueError(f"CPU numbers go up to {MAX_CPU}")
        cpus.update(range(a, b + 1))
    return frozenset(cpus)


def _node_cross(v: Mapping[str, Any]) -> list[str]:
    try:
        parse_cpus(v["cpu_affinity"])
    except ValueError as e:
        return [
            f"parameter cpu_affinity={v['cpu_affinity']!r} ({e}); accepts CPU numbers and "
            "ranges as taskset -c takes them"
        ]
    names = [c.partition(":")[0] for c in v["cameras"]]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        return [
            f"parameter cameras={list(v['cameras'])!r} ({dup!r} appears twice); accepts "
            "each camera name at most once"
        ]
    if "joint_states" in names:
        return [
            f"parameter cameras={list(v['cameras'])!r}; accepts any camera name but "
            "'joint_states' (step_on would not tell the camera from the joint states)"
        ]
    step_on = list(v["step_on"])
    unknown = [s for s in step_on if s != "joint_states" and s not in names]
    if unknown:
        return [
            f"parameter step_on={step_on!r} ({unknown[0]!r} is neither joint_states nor a "
            f"camera of cameras={names!r}); accepts joint_states and the camera names"
        ]
    if v["trigger"] == "timer" and step_on != ["joint_states"]:
        return [
            f"parameter step_on={step_on!r}; accepts only the default ['joint_states'] with "
            "trigger=timer (the timer steps at rate_hz; step_on picks the observation trigger's "
            "inputs)"
        ]
    if v["trigger"] == "timer" and v["publish_offset_s"] >= 1.0 / v["rate_hz"]:
        return [
            f"parameter publish_offset_s={v['publish_offset_s']!r}; accepts a value below "
            f"the period 1/rate_hz = {1.0 / v['rate_hz']:.6g} s in timer mode"
        ]
    return []


# a camera: a ROS name token (it becomes part of camera/<name>/image_raw), then an encoding

NODE_PARAMS = ParamTable(
    [
        Param(
            "policy",
            "builtin:hybrid",
            "string",
            "policy spec: builtin:hybrid, builtin:act, builtin:diffusion, package.module:factory "
            "or a .pt2 path",
            pattern=r"(?s).*\S.*",
            pattern_text="a non-empty string",
        ),
        Param(
            "weights",
            "",
            "string",
            "weights file for the policy ('' = the shipped weights); a package.module:factory "
            "policy gets it as weights= (one without that argument is refused), a .pt2 file "
            "carries its own",
        ),
        Param(
            "device",
            "auto",
            "string",
            "compute device: auto (CUDA when present), cpu, cuda or cuda:N",
            pattern=r"auto|cpu|cuda(:[0-9]+)?",
            pattern_text="'auto', 'cpu', 'cuda' or 'cuda:N'",
        ),
        Param(
            "trigger",
            "timer",
            "string",
            "timer: step at rate_hz; observation: step as messages arrive (one per "
            "joint_states message, or as step_on says)",
            choices=("timer", "observation"),
        ),
        Param(
            "rate_hz",
            100.0,
            "double",
            "control rate in timer mode (also the point spacing of joint_trajectory)",
            lo=0.1,
            hi=10000.0,
        ),
        Param(
            "joint_names",
            DEFAULT_JOINTS,
            "string_array",
            "joints of the observation and the command, in order",
            unique=True,
            min_items=1,
        ),
        Param(
            "state_fields",
            list(DEFAULT_FIELDS),
            "string_array",
            "the joint_states arrays that make the observation, each for every joint of "
            "joint_names in order: [position, velocity] (builtin:hybrid), [position] (most "
            "LeRobot policies); the policy's state size must be their number x the joints",
            pattern="|".join(FIELDS),
            pattern_text=" or ".join(FIELDS),
            unique=True,
            min_items=1,
        ),
        Param(
            "output",
            "commands",
            "string",
            "what is published: commands, joint_trajectory or both",
            choices=("commands", "joint_trajectory", "both"),
        ),
        Param(
            "obs_timeout_s",
            0.5,
            "double",
            "older observations are stale: no step, no command, the robot holds (observation "
            "trigger: a joint_states received longer ago, one that queued behind a stall, is "
            "refused as stale, not stepped on)",
            lo=0.001,
            hi=60.0,
            live=True,
        ),
        Param(
            "publish_offset_s",
            0.0,
            "double",
            "timer mode: publish each command this long after its tick's deadline (0 = as soon "
            "as computed; below 1/rate_hz); above the step's p99 it trades latency for a "
            "steady output phase",
            lo=0.0,
            hi=1.0,
            live=True,
        ),
        Param(
            "realtime_priority",
            0,
            "integer",
            "SCHED_FIFO priority of the thread that steps (the control thread in timer mode, "
            "the inputs' thread in observation mode), so no other process delays a tick (a "
            "compressed camera's decode thread, which steps when its frame completes a step_on "
            "set, keeps normal scheduling); "
            "needs CAP_SYS_NICE or an rtprio limit, else a warning and normal scheduling "
            "(0 = normal scheduling); the node's other threads keep the scheduling the process "
            "was started with (`chrt --idle` or `--batch` holds for them)",
            lo=0,
            hi=99,
        ),
        Param(
            "cpu_affinity",
            "",
            "string",
            "CPUs the thread that steps runs on (as `taskset -c` takes them: '3', '2,3', "
            "'4-7'), so the scheduler never moves it to a CPU whose caches are cold; pair it "
            "with CPUs kept free of other work (isolcpus, a cpuset); CPUs this process may not "
            "use give a warning and no pinning ('' = any CPU)",
            pattern=CPU_LIST,
            pattern_text="CPU numbers and ranges as taskset -c takes them, e.g. '3', '2,3' or "
            "'4-7' ('' = any CPU)",
            int_as_text=True,
        ),
        Param(
            "busy_wait",
            False,
            "bool",
            "while active, the thread that steps polls for its inputs and requests between "
            "ticks instead of sleeping: one CPU core at 100 %, no sleep to wake from, and ticks "
            "and requests run on a core whose caches are warm (on a virtual machine a sleeping "
            "CPU gives its core away); the node's other Python threads (rollouts, parameter and "
            "lifecycle requests) get the GIL between two looks, usually within 0.1 ms but at "
            "times a few ms (2-core CPU machine), so rollouts run slower; with "
            "realtime_priority, the kernel's real-time throttling stalls a thread that never "
            "sleeps (a warning says so)",
        ),
        Param(
            "capsule_slots",
            16,
            "integer",
            "GPU capsule pool slots, each one state arena",
            lo=1,
            hi=1 << 20,
        ),
        Param(
            "host_capsule_slots",
            0,
            "integer",
            "pinned-host slots that evicted capsules spill to (0 = dropped)",
            lo=0,
            hi=1 << 20,
        ),
        Param(
            "capsule_dir",
            "",
            "string",
            "folder for persisted capsules, reloaded at configure ('' = none; made when "
            "missing); one node's: a second node given it fails its configure",
        ),
        Param(
            "compile_cache_dir",
            "~/.cache/flashrt_ros/compile",
            "string",
            "inductor's and Triton's kernel caches, and the fused step compiled ahead of time, "
            "go to <this>/<engine fingerprint>, so a warm start loads the compiled step and "
            "another policy, weights or code never meets it ('' = torch's defaults, and no step "
            "saved)",
        ),
        Param(
            "fuse",
            True,
            "bool",
            "on CUDA, compile the step with inductor before it is captured: fewer, fused kernels "
            "(builtin:hybrid steps in ~95 us instead of ~200 us on the H200), for 2.5-3.5 s more "
            "at a warm start and about 20 s more at a cold one; false captures the plain step "
            "(a warm start of 2.95 s against 5.42 s fused in one H200 run, most of it importing "
            "torch and rclpy); no effect on the CPU, which never compiles",
        ),
        Param(
            "late_fuse",
            False,
            "bool",
            "with fuse: start on the plain captured step and build the fused one in a background "
            "thread after the first command, swapped in between two ticks once checked: a first "
            "command as early as an unfused start (2.7-3.2 s against 5.1-6.1 s warm, medians on "
            "three H200 machines), but during the ~5 s build the 500 Hz loop runs at ~480 Hz "
            "(longest interval 10-18 ms) and a state stepped across the swap continues within "
            "float reassociation, not bit for bit (off by default, so bag replays are bit-exact)",
        ),
        Param(
            "max_sessions",
            4,
            "integer",
            "sessions that may exist at once (live one and branches)",
            lo=1,
            hi=(1 << 16) - 1,
        ),
        Param("seed", 0, "integer", "seed of the policy's noise state", lo=0, hi=(1 << 31) - 1),
        Param(
            "obs_limit",
            1000.0,
            "double",
            "observations and goals with any |value| above this are refused (a sanity bound, "
            "not joint limits)",
            lo=1e-3,
            hi=1e9,
        ),
        Param(
            "max_rollout_steps",
            10000,
            "integer",
            "the longest ~/rollout request accepted",
            lo=1,
            hi=1_000_000,
            live=True,
        ),
        Param(
            "rollout_timeout_s",
            0.0,
            "double",
            "a ~/rollout still running after this many seconds stops and answers how far it got "
            "(0 = no limit; its steps wait for room between control ticks, so on a loaded "
            "machine a long rollout can take minutes)",
            lo=0.0,
            hi=86400.0,
            live=True,
        ),
        Param(
            "flight_ticks",
            0,
            "integer",
            "states of the last N ticks kept per session for ~/rewind and ~/dump_flight, the "
            "current one included: a rewind goes back at most N-1 ticks (0 = off)",
            lo=0,
            hi=100_000,
        ),
        Param(
            "flight_dump_max_mb",
            256.0,
            "double",
            "disk bound of the automatic flight dumps in capsule_dir/flight (a step error, a "
            "deactivate, a stop while active); the oldest go first (0 = no automatic dumps)",
            lo=0.0,
            hi=1e7,
            live=True,
        ),
        Param(
            "flight_dump_interval_s",
            10.0,
            "double",
            "at most one automatic flight dump per this many seconds",
            lo=0.0,
            hi=86400.0,
            live=True,
        ),
        Param(
            "cameras",
            [],
            "string_array",
            "cameras, each subscribed on camera/<name>/image_raw (sensor_msgs/Image) and fed to "
            "the policy's input observation.images.<name>: exactly the policy's image inputs; "
            "name:encoding fixes the encoding (rgb8, bgr8, mono8; default rgb8, mono8 for a "
            "1-channel input), other encodings, sizes and steps are refused; name:compressed "
            "subscribes camera/<name>/image_raw/compressed (sensor_msgs/CompressedImage, JPEG "
            "or PNG) instead, decoded on a thread of its own (about 1-2.5 ms a 640x480 JPEG)",
            pattern=CAMERA_RE,
            pattern_text="name, name:encoding or name:compressed (a letter, then letters, "
            "digits or _; rgb8, bgr8 or mono8)",
            unique=True,
        ),
        Param(
            "step_on",
            ["joint_states"],
            "string_array",
            "observation trigger: the inputs whose new messages make a step, joint_states "
            "and/or camera names; a step comes once every listed input has a new valid message "
            "since the last step, on the newest of every input. [joint_states]: one step per "
            "joint_states message, none dropped; the camera names: one step per camera frame "
            "set, at the cameras' rate, with no wait for the next joint_states (which must "
            "still be newer than obs_timeout_s)",
            pattern=r"[A-Za-z][A-Za-z0-9_]*",
            pattern_text="joint_states or a camera name",
            unique=True,
            min_items=1,
        ),
        Param("autostart", True, "bool", "configure and activate at start"),
    ],
    "NodeConfig",
    cross=_node_cross,
)


NodeConfig = NODE_PARAMS.Config
YAML_HEADER = (
    "Defaults of the flashrt node, generated from flashrt_ros/node/params.py:\n"
    "  python -m flashrt_ros.node.params --yaml > config/flashrt.yaml\n"
    "`/**:` matches the node whatever its name or namespace:\n"
    "  flashrt_node --ros-args --params-file config/flashrt.yaml"
)


def declare(node, argv: Sequence[str] | None = None) -> NodeConfig:
    """Declare the flashrt node's parameters; live sets replace `node.cfg` (when configured)."""

    def on_change(changes: dict[str, Any]) -> None:
        cfg = getattr(node, "cfg", None)
        if cfg is not None:  # one assignment: readers see the old config or the new one
            node.cfg = dataclasses.replace(cfg, **changes)

    return NODE_PARAMS.declare(node, argv, on_change)


def read(node) -> NodeConfig:
    """Read and check every parameter; ParamError names the bad one and what it accepts."""
    return NODE_PARAMS.read(node)


if __name__ == "__main__":
    if sys.argv[1:] == ["--yaml"]:
        sys.stdout.write(NODE_PARAMS.yaml_text(YAML_HEADER))
    elif sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(NODE_PARAMS.markdown_table())
    else:
        sys.stdout.write(NODE_PARAMS.help_text() + "\n")
