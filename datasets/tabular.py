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
             group_values: Optional[list] = None, categories: Optional[dict] = None,
             test_path: Optional[str] = None, comment: Optional[str] = None) -> DatasetBundle:
    """Load one CSV file as a classification task.

    ``path`` is absolute or relative to ``dataset.root``. Without a header row (Adult's ``adult.data``), name the
    columns with ``columns``. Categorical columns are ``categorical_columns``, or by default every column holding a
    non-numeric value; they are one-hot encoded (a missing value, e.g. Adult's ``?``, is its own category).
    Numeric columns are standardised over all rows (missing values take the column mean). Labels are the sorted
    distinct label strings (whitespace and a trailing '.' stripped). With ``group_column`` each row's group is its
    value there (sorted distinct values); with ``group_values`` too, group 1 = rows whose value is listed and group
    0 = the rest (e.g. PCFL's Adult split: PhD client vs non-PhD client: group_column=education,
    group_values=[Doctorate]).

    ``categories`` fixes a categorical column's one-hot codes (column -> its values, in code order): a missing value
    is all zeros, a value not listed is refused. ``test_path`` names a second file of the same columns holding the
    dataset's own test rows (``DatasetBundle.test_rows``; ``split.test=dataset`` tests each client on its rows
    there); numeric columns are then standardised with the training rows' statistics only. Lines whose first field
    starts with ``comment`` are skipped (Adult's ``adult.test`` opens with ``|1x3 Cross validator``).
    """
    if path is None:
        raise DataError("dataset 'csv': set dataset.path to the CSV file")
    if label_column is None:
        raise DataError("dataset 'csv': set dataset.label_column to the name of the label column")
    file = _csv_file(root, path, "dataset.path")
    missing_set = {m.strip() for m in (missing_values if missing_values is not None else ["?", ""])}
    rows = _read_rows(file, comment)
    n_test = 0
    if test_path is not None:
        test_file = _csv_file(root, test_path, "dataset.test_path")
        test_rows = _read_rows(test_file, comment)
        if header:
            test_rows = test_rows[1:]
        if not test_rows:
            raise DataError(f"dataset 'csv': '{test_file}' (dataset.test_path) has no data rows")
        n_test = len(test_rows)
        rows = rows + test_rows  # the test rows last: test_rows marks them
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
    bad = [i for i, r in enumerate(rows) if len(r) != len(names)]
    if bad:
        where = (f"'{file}' line {bad[0] + 1 + int(header)}" if bad[0] < len(rows) - n_test
                 else f"'{test_file}' data row {bad[0] - (len(rows) - n_test) + 1}")
        raise DataError(f"dataset 'csv': {where} has a different number of fields than the "
                        f"{len(names)} columns {names}")
    col = {n: i for i, n in enumerate(names)}
    for key, value in (("label_column", [label_column]), ("group_column", [group_column] if group_column else []),
                       ("categorical_columns", categorical_columns or []), ("drop_columns", drop_columns or []),
                       ("categories", list(categories or {}))):
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
    fit_rows = slice(0, len(table) - n_test)  # standardisation statistics: the training rows only
    for n in features:
        values = table[:, col[n]]
        if categories is not None and n in categories:
            blocks.append(_fixed_one_hot(values.astype(str), [str(v) for v in categories[n]], missing_set, n))
            feature_names += [f"{n}={c}" for c in categories[n]]
            encoding[n] = [str(v) for v in categories[n]]
        elif n in categorical:
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
            fit = num[fit_rows]
            mean = np.nanmean(fit) if present[fit_rows].any() else 0.0
            num[~present] = mean
            std = num[fit_rows].std()
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
    test_mask = None
    if test_path is not None:
        test_mask = torch.zeros(len(table), dtype=torch.bool)
        test_mask[len(table) - n_test:] = True
    return DatasetBundle(x=x, y=y, task=classification(len(class_names)), input_shape=(x.shape[1],),
                         groups=groups, group_names=group_names, class_names=class_names,
                         meta={"source": str(file), "feature_names": feature_names, "categories": encoding,
                               **({"test_source": str(test_file), "test_rows": n_test} if test_path else {})},
                         test_rows=test_mask)


def _csv_file(root: Optional[str], path: str, key: str) -> Path:
    file = Path(path).expanduser()
    if not file.is_absolute():
        file = data_root(root) / file
    if not file.is_file():
        raise DataError(f"dataset 'csv': file '{file}' does not exist ({key}: absolute, or relative to "
                        f"{root_words(root)})")
    return file


def _read_rows(file: Path, comment: Optional[str]) -> List[List[str]]:
    try:
        with open(file, newline="", encoding="utf-8") as fh:
            return [[c.strip() for c in r] for r in csv.reader(fh, skipinitialspace=True)
                    if any(c.strip() for c in r) and not (comment and r[0].strip().startswith(comment))]
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"dataset 'csv': '{file}' is not a UTF-8 CSV text file ({type(exc).__name__}: "
                        f"{str(exc)[:100]})") from None


def _fixed_one_hot(values: np.ndarray, cats: List[str], missing: set, column: str) -> np.ndarray:
    """One-hot codes over the fixed ``cats``; a missing value is all zeros; an unlisted value is refused."""
    code = {c: i for i, c in enumerate(cats)}
    unknown = sorted({v for v in values if v not in code and v not in missing})
    if unknown:
        raise DataError(f"dataset.categories: column '{column}' holds {unknown[:3]} ({len(unknown)} value(s)) not "
                        f"in its listed categories {cats[:5]}{'...' if len(cats) > 5 else ''}")
    out = np.zeros((len(values), len(cats)), dtype=np.float32)
    rows = np.array([i for i, v in enumerate(values) if v in code], dtype=np.int64)
    if len(rows):
        out[rows, [code[values[i]] for i in rows]] = 1.0
    return out


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
    "categories": Param(None, "column -> its categories in code order: fixed one-hot codes (missing: all zeros)",
                        type=dict),
    "test_path": Param(None, "a second file of the same columns: the dataset's own test rows (split.test=dataset)",
                       type=str),
    "comment": Param(None, "skip lines whose first field starts with this text", type=str),
}

ADULT_COLUMNS = ["age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
                 "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country",
                 "income"]


# The categorical columns' values in the order of UCI's adult.names: the fixed one-hot codes of
# ``features = categorical`` (8 columns, 99 codes; '?' is all zeros), as the PCFL authors' Adult generation encodes them
ADULT_CATEGORIES = {
    "workclass": ["Private", "Self-emp-not-inc", "Self-emp-inc", "Federal-gov", "Local-gov", "State-gov",
                  "Without-pay", "Never-worked"],
    "education": ["Bachelors", "Some-college", "11th", "HS-grad", "Prof-school", "Assoc-acdm", "Assoc-voc", "9th",
                  "7th-8th", "12th", "Masters", "1st-4th", "10th", "Doctorate", "5th-6th", "Preschool"],
    "marital-status": ["Married-civ-spouse", "Divorced", "Never-married", "Separated", "Widowed",
                       "Married-spouse-absent", "Married-AF-spouse"],
    "occupation": ["Tech-support", "Craft-repair", "Other-service", "Sales", "Exec-managerial", "Prof-specialty",
                   "Handlers-cleaners", "Machine-op-inspct", "Adm-clerical", "Farming-fishing", "Transport-moving",
                   "Priv-house-serv", "Protective-serv", "Armed-Forces"],
    "relationship": ["Wife", "Own-child", "Husband", "Not-in-family", "Other-relative", "Unmarried"],
    "race": ["White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black"],
    "sex": ["Female", "Male"],
    "native-country": ["United-States", "Cambodia", "England", "Puerto-Rico", "Canada", "Germany",
                       "Outlying-US(Guam-USVI-etc)", "India", "Japan", "Greece", "South", "China", "Cuba", "Iran",
                       "Honduras", "Philippines", "Italy", "Poland", "Jamaica", "Vietnam", "Mexico", "Portugal",
                       "Ireland", "France", "Dominican-Republic", "Laos", "Ecuador", "Taiwan", "Haiti", "Columbia",
                       "Hungary", "Guatemala", "Nicaragua", "Scotland", "Thailand", "Yugoslavia", "El-Salvador",
                       "Trinadad&Tobago", "Peru", "Hong", "Holand-Netherlands"],
}
ADULT_NUMERIC = ["age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week"]


def _adult_file(root: Optional[str], path: str, key: str) -> str:
    """``path`` looked up in dataset.root, then in adult/ under it (fl data install); returned absolute, so
    load_csv does not join dataset.root a second time."""
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
                            f"{key} to the file")
        return str(found.absolute())
    if not file.is_file():
        raise DataError(f"dataset 'adult': {key} '{file}' does not exist; get Adult with "
                        f"`{install_command('adult', root)}`")
    return str(file)


def load_adult(root: Optional[str] = None, download: bool = False, path: str = "adult.data",
               group_values: Optional[list] = None, features: str = "all",
               test_path: Optional[str] = None) -> DatasetBundle:
    """UCI Adult (census income >50K) from its headerless ``adult.data`` in ``dataset.root`` (or ``adult/`` under
    it, where ``fl data install adult`` puts it), label ``income``. Groups: education; with ``group_values`` (e.g.
    [Doctorate]) PCFL's two clients, listed values vs the rest.

    ``features``: ``all`` -- the 12 informative columns, categorical ones one-hot over the values present (a '?' its
    own code), numeric ones standardised; ``fnlwgt`` (a sampling weight) and ``education-num`` (a duplicate of
    education) dropped. ``categorical`` -- only the 8 categorical columns, one-hot over UCI's listed values (99
    inputs, '?' all zeros), every numeric column dropped: the PCFL authors' encoding (their Adult generation keeps
    categorical features only). ``test_path`` (e.g. ``adult.test``): UCI's own test file, marked as the dataset's
    test rows for ``split.test = dataset``.
    """
    categorical = features == "categorical"
    return load_csv(root, download, path=_adult_file(root, path, "dataset.path"), label_column="income",
                    header=False, columns=ADULT_COLUMNS,
                    drop_columns=ADULT_NUMERIC if categorical else ["fnlwgt", "education-num"],
                    categories=ADULT_CATEGORIES if categorical else None,
                    group_column="education", group_values=group_values,
                    test_path=None if test_path is None else _adult_file(root, test_path, "dataset.test_path"),
                    comment="|")


load_adult.sources = (ADULT,)

load_adult.params = {
    "path": Param("adult.data", "the headerless Adult CSV (absolute, or relative to dataset.root)"),
    "group_values": Param(None, "education values forming group 1 (default: one group per education value)",
                          type=list),
    "features": Param("all", "all: categorical columns one-hot and numeric ones standardised; categorical: the 8 "
                             "categorical columns only, over UCI's listed values (99 inputs, PCFL's encoding)",
                      choices=("all", "categorical")),
    "test_path": Param(None, "UCI's test file (e.g. adult.test): the dataset's own test rows, for "
                             "split.test=dataset", type=str),
}
# rows of numbers, not images: the built-in image models cannot read them
load_adult.defaults = {"model": {"name": "mlp"}}
load_csv.defaults = {"model": {"name": "mlp"}}
