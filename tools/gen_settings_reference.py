"""Write docs/reference/settings.md from the settings' own definitions (the ``#:`` comments
of ``engine.config.Settings``): python tools/gen_settings_reference.py"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import msgspec

from engine.config import Settings

DOC = Path(__file__).resolve().parent.parent / "docs" / "reference" / "settings.md"

_FIELD = re.compile(r"^    (\w+): ")

HEADER = """\
# Settings

Generated from `engine.config.Settings` by `python tools/gen_settings_reference.py`.

One settings struct, `engine.config.Settings`, read in this order (later wins):

1. the defaults below;
2. the `[deferral]` table of the settings file: the one named by `--config PATH` (a flag of
   `deferral` itself, before the command) or `DEFERRAL_CONFIG`; else `deferral.toml` in the
   current folder; else `deferral.toml` in the home folder (`DEFERRAL_HOME`, `--home`);
3. environment variables `DEFERRAL_<NAME>`;
4. command-line flags (`--database-url`, `--home`, `--dags`, `--slots`, `--capacity`,
   `--metrics-port`, ...).

Values are decoded and checked with msgspec. An unknown key in the file, a value of the
wrong type (in the file, `worker_slots = "8"` is a string, not a number) or out of range is
an error that names the setting and where its value came from: the file and the line, the
environment variable or the flag. (TOML decoders report no positions for values: the line is
found by looking for `name =` under the `[deferral]` header.) Such an error never quotes the
value of `database_url` or `fernet_key`, only the type expected and given (a `database_url`
that is not a `postgresql://` URL, or whose port does not parse, is refused the same way);
other values are quoted with any secret in them masked. Durations are in seconds, as the names
say.

`deferral config show` prints every setting with its value and where it came from
(`default`, `FILE:LINE`, `env DEFERRAL_NAME`, `flag --name`); `--effective` shows what the
processes derive from unset or relative values (`derived`: the embedded database's folder,
the key file, the allow-list's patterns; folders made absolute); `--json` prints the same as
one JSON array of `{"setting", "value", "source"}` objects. Keys are shown as `<hidden>`, and
passwords in URLs (and any other secret a value holds) as `***`: see
[secrets masking](../explanation/security.md#secrets-masking).

```toml
# deferral.toml
[deferral]
database_url = "postgresql://deferral@db.internal/deferral"
dags_folder = "dags"
worker_slots = 32
triggerer_capacity = 20000
metrics_port = 9464
```

| setting | environment | default | meaning |
|---|---|---|---|
"""

FOOTER = """
The built-in operators and triggers never import the runtime, and the runtime never writes
the environment to reach them: operators get what they need in their context at run time
(`default_deferrable`), and connections are the variables `DEFERRAL_CONN_<ID>` you set (see
[triggers and sensors](triggers-and-sensors.md#connections)); the id `deferral`, the engine's
own database, is handed over by each process without a variable.
"""


def field_docs() -> dict[str, str]:
    """Each field's ``#:`` comment lines, joined."""
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(Settings).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = _FIELD.match(line)
        if match:
            docs[match.group(1)] = "\n".join(pending)
        pending = []
    return docs


def _default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def row(field: msgspec.structs.FieldInfo, doc: str) -> str:
    lines = doc.splitlines()
    default = _default(field.default)
    if lines and lines[-1].startswith("Default: "):
        default = lines.pop().removeprefix("Default: ")
    meaning = " ".join(lines)
    env = f"DEFERRAL_{field.name.upper()}"
    return f"| `{field.name}` | `{env}` | {default} | {meaning} |"


def render() -> str:
    docs = field_docs()
    rows = []
    for field in msgspec.structs.fields(Settings):
        doc = docs.get(field.name, "")
        if not doc:
            raise SystemExit(f"setting {field.name} has no #: comment in engine/config/settings.py")
        rows.append(row(field, doc))
    return HEADER + "\n".join(rows) + "\n" + FOOTER


def main() -> None:
    DOC.write_text(render())
    print(f"wrote {DOC}", file=sys.stderr)


if __name__ == "__main__":
    main()
