"""Tabular classification from a CSV file (Adult-style census data): categorical columns one-hot encoded,
numeric columns standardised, a named label column."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

from pflkit.core.data.data import DatasetBundle, root_words
from pflkit.core.common.errors import DataError
from pflkit.core.api.params import Param
from pflkit.core.api.task import classification

from ._common import data_root, install_command
from .packaged import ADULT


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _clean_label(text: str) -> str:
    # Adult's test file writes ">50K." where the train file writes ">50K"
    return text.strip().rstrip(".").strip()


def load_csv(root: Optional[str] = None, download: bool = False, path: Optional[str] = None,
             label_column: Optional[str] = None, header: bool = True, columns: Optional[list] = None,
             categorical_columns: Optional[list] = None, drop_columns: Optional[list] = None,
             missing_values: Optional[list] = None, group_column: Optional[str] = None,
             group_values: Optional[list] = None) -> DatasetBundle:
    """Load one CSV file as a classification task.

    ``path`` is absolute or relative to ``dataset.root``. Without a header row (Adult's ``adult.data``), name the
    columns with ``columns``. Categorical columns are ``categorical_columns``, or by default every column holding a
    non-numeric value; they are one-hot encoded (a missing value, e.g. Adult's ``?``, is its own category).
    Numeric columns are standardised over all rows (missing values take the column mean). Labels are the sorted
    distinct label strings (whitespace and a trailing '.' stripped). With ``group_column`` each row's group is its
    value there (sorted distinct values); with ``group_values`` too, group 1 = rows whose value is listed and group
    0 = the rest (e.g. PCFL's Adult split: PhD client vs non-PhD client: group_column=education,
    group_values=[Doctorate]).
    """
    if path is None:
        raise DataError("dataset 'csv': set dataset.path to the CSV file")
    if label_column is None:
        raise DataError("dataset 'csv': set dataset.label_column to the name of the label column")
    file = Path(path).expanduser()
    if not file.is_absolute():
        file = data_root(root) / file
    if not file.is_file():
        raise DataError(f"dataset 'csv': file '{file}' does not exist (dataset.path: absolute, or relative to "
                        f"{root_words(root)})")
    missing_set = {m.strip() for m in (missing_values if missing_values is not None else ["?", ""])}
    try:
        with open(file, newline="", encoding="utf-8") as fh:
            rows = [[c.strip() for c in r] for r in csv.reader(fh, skipinitialspace=True)
                    if any(c.strip() for c in r)]
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"dataset 'csv': '{file}' is not a UTF-8 CSV text file ({type(exc).__name__}: "
                        f"{str(exc)[:100]})") from None
    if header:
        if not rows:
            raise DataError(f"dataset 'csv': '{file}' is empty")
        names, rows = rows[0], rows[1:]
        if columns is not None:
            names = list(columns)
    else:
        names = list(columns) if columns is not None else [str(i) for i in range(len(rows[0]) if rows else 0)]
    if not rows:
        raise DataError(f"dataset 'csv': '{file}' has no data rows")
    bad = [i + 1 + int(header) for i, r in enumerate(rows) if len(r) != len(names)]
    if bad:
        raise DataError(f"dataset 'csv': '{file}' line {bad[0]} has a different number of fields than the "
                        f"{len(names)} columns {names}")
    col = {n: i for i, n in enumerate(names)}
    for key, value in (("label_column", [label_column]), ("group_column", [group_column] if group_column else []),
                       ("categorical_columns", categorical_columns or []), ("drop_columns", drop_columns or [])):
        unknown = [v for v in value if v not in col]
        if unknown:
            raise DataError(f"dataset.{key}: column(s) {unknown} not in '{file}'; columns are {names}")
    table = np.asarray(rows, dtype=object)
    labels_raw = [_clean_label(v) for v in table[:, col[label_column]]]
    class_names = sorted(set(labels_raw))
    y = torch.from_numpy(np.searchsorted(np.asarray(class_names), np.asarray(labels_raw)).astype(np.int64))
    skip = {label_column, *(drop_columns or [])}
    features = [n for n in names if n not in skip]
    if categorical_columns is None:
        categorical = [n for n in features
                       if not all(_is_number(v) for v in table[:, col[n]] if v not in missing_set)]
    else:
        categorical = list(categorical_columns)
    blocks: List[np.ndarray] = []
    feature_names: List[str] = []
    encoding: Dict[str, List[str]] = {}
    for n in features:
        values = table[:, col[n]]
        if n in categorical:
            cats, codes = np.unique(values.astype(str), return_inverse=True)
            blocks.append(np.eye(len(cats), dtype=np.float32)[codes])
            feature_names += [f"{n}={c}" for c in cats]
            encoding[n] = cats.tolist()
        else:
            present = np.array([v not in missing_set for v in values])
            num = np.full(len(values), np.nan)
            try:
                num[present] = values[present].astype(np.float64)
            except ValueError as exc:
                raise DataError(f"dataset 'csv': column '{n}' is listed as numeric but holds text ({exc}); "
                                f"add it to dataset.categorical_columns") from exc
            mean = np.nanmean(num) if present.any() else 0.0
            num[~present] = mean
            std = num.std()
            blocks.append(((num - mean) / (std if std > 0 else 1.0)).astype(np.float32)[:, None])
            feature_names.append(n)
    if not blocks:
        raise DataError(f"dataset 'csv': no feature columns left in '{file}' after dropping {sorted(skip)}")
    x = torch.from_numpy(np.concatenate(blocks, axis=1))
    groups = group_names = None
    if group_column is not None:
        gvals = table[:, col[group_column]].astype(str)
        if group_values is not None:
            wanted = {str(v).strip() for v in group_values}
            groups = torch.tensor([int(v in wanted) for v in gvals], dtype=torch.long)
            group_names = ["other", "+".join(sorted(wanted))]
        else:
            uniq, codes = np.unique(gvals, return_inverse=True)
            groups, group_names = torch.from_numpy(codes.astype(np.int64)), uniq.tolist()
    return DatasetBundle(x=x, y=y, task=classification(len(class_names)), input_shape=(x.shape[1],),
                         groups=groups, group_names=group_names, class_names=class_names,
                         meta={"source": str(file), "feature_names": feature_names, "categories": encoding})


load_csv.params = {
    "path": Param(None, "CSV file (absolute, or relative to dataset.root)", type=str),
    "label_column": Param(None, "name of the label column", type=str),
    "header": Param(True, "the first row names the columns"),
    "columns": Param(None, "column names (for files without a header row, e.g. adult.data)", type=list),
    "categorical_columns": Param(None, "columns to one-hot encode (default: every non-numeric column)", type=list),
    "drop_columns": Param(None, "columns to ignore", type=list),
    "missing_values": Param(None, "strings meaning 'missing' (default: '?' and empty)", type=list),
    "group_column": Param(None, "column whose value is each row's group (for by_group)", type=str),
    "group_values": Param(None, "with group_column: values forming group 1 (the rest is group 0)", type=list),
}

ADULT_COLUMNS = ["age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
                 "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country",
                 "income"]


def load_adult(root: Optional[str] = None, download: bool = False, path: str = "adult.data",
               group_values: Optional[list] = None) -> DatasetBundle:
    """UCI Adult (census income >50K) from its headerless ``adult.data`` in ``dataset.root`` (or ``adult/`` under
    it, where ``fl data install adult`` puts it): 14 features, label ``income``; ``fnlwgt`` (a sampling weight) and
    ``education-num`` (a duplicate of education) are dropped. Groups: education; with ``group_values`` (e.g.
    [Doctorate]) PCFL's two clients, listed values vs the rest."""
    file = Path(path).expanduser()
    if not file.is_absolute():
        base = data_root(root)
        # the path is looked up in dataset.root, then in adult/ under it (fl data install); what is found is passed
        # on absolute, so load_csv does not join dataset.root a second time
        candidates = [base / file, base / ADULT.folder / file]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise DataError(f"dataset 'adult': {path} does not exist in {candidates[1].parent} or {base} "
                            f"({root_words(root)}); get it with `{install_command('adult', root)}`, or set "
                            f"dataset.path to the file")
        file = found.absolute()
    elif not file.is_file():
        raise DataError(f"dataset 'adult': dataset.path '{file}' does not exist; get Adult with "
                        f"`{install_command('adult', root)}`")
    path = str(file)
    return load_csv(root, download, path=path, label_column="income", header=False, columns=ADULT_COLUMNS,
                    drop_columns=["fnlwgt", "education-num"], group_column="education", group_values=group_values)


load_adult.sources = (ADULT,)

load_adult.params = {
    "path": Param("adult.data", "the headerless Adult CSV (absolute, or relative to dataset.root)"),
    "group_values": Param(None, "education values forming group 1 (default: one group per education value)",
                          type=list),
}
# rows of numbers, not images: the built-in image models cannot read them
load_adult.defaults = {"model": {"name": "mlp"}}
load_csv.defaults = {"model": {"name": "mlp"}}
