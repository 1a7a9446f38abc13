"""API models built from store rows: same-named columns copy, the rest is given."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

_Model = TypeVar("_Model", bound=BaseModel)


def from_row(model: type[_Model], row: object, **values: Any) -> _Model:
    """`model` validated from `row`'s attributes of its field names, `values` overriding.

    `values` carry what the row does not hold as the API shows it: a renamed id, a
    timestamp as ISO text, figures computed from other rows. A field that neither gives
    falls to the model's default, or fails validation if it has none.
    """
    names = model.model_fields.keys() - values.keys()
    copied = {name: getattr(row, name) for name in names if hasattr(row, name)}
    return model.model_validate(copied | values)
