"""Evidence for the claim of [NED] on real data: NED confidence vs kNN vote and 1-NN, clean and corrupted.

Protocol [NED, Sec. 3.2 and 5]: a small embedding network is trained with a normalised,
temperature-weighted softmax ([NED, Sec. 3], following Zhai & Wu) on five Fashion-MNIST classes;
the support set and the queries come from the five *other* classes (disjoint categories, as in
the benchmarks of [NED]). All heads share the support and k = 20; NED's T is fitted leave-one-out on the
support (the default); the test queries are then corrupted at severities 3 and 5 (support and T
unchanged, as in [NED, Sec. 5]). The numbers are recorded in docs/heads_metrics.md.

What reproduces, and is asserted: NED is far better calibrated than 1-NN on clean and on every
corrupted set, at equal or better accuracy, and as accurate as the kNN vote. What does NOT
reproduce at this scale: [NED, Tables 1-2] have NED's ECE well below the kNN vote's; here the vote
share of k = 20 neighbours is about as well calibrated as NED on clean data (1-2% ECE, the order
changes between training runs) and better calibrated under severity-5 corruption. Only "comparable
on clean data" is asserted; the numbers are in docs/heads_metrics.md.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shiftguard.corruptions import corrupt
from shiftguard.heads import NED, KNNVote, OneNN
from shiftguard.metrics import accuracy, ece

TRAIN_CLASSES = (0, 2, 4, 6, 8)
TEST_CLASSES = (1, 3, 5, 7, 9)
SHIFTS = [("shot_noise", 3), ("shot_noise", 5), ("motion_blur", 3), ("motion_blur", 5)]


class TinyEmbeddingNet(nn.Module):
    """Two strided convolutions and a linear layer to a unit-norm 32-d embedding."""

    def __init__(self, num_classes: int, dim: int = 32, scale: float = 10.0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 5, stride=2, padding=2)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16 * 7 * 7, dim)
        self.proxies = nn.Parameter(0.1 * torch.randn(num_classes, dim))
        self.scale = scale

    def embed(self, images_uint8):
        x = F.relu(self.conv1(images_uint8.float() / 255.0))
        x = F.relu(self.conv2(x))
        return F.normalize(self.fc(x.flatten(1)), dim=1)

    def forward(self, images_uint8):
        # normalised softmax with temperature 1/scale [NED, Sec. 3]
        return self.scale * self.embed(images_uint8) @ F.normalize(self.proxies, dim=1).t()


def _shift(images, name, severity):
    return corrupt(images, name, severity, seed=0)


_CACHE: dict = {}


@pytest.fixture
def results(fashion_mnist_dir):
    """Train once per session (the data fixture is function-scoped, so cache here)."""
    if "results" not in _CACHE:
        _CACHE["results"] = _run_experiment(fashion_mnist_dir)
    return _CACHE["results"]


def _run_experiment(data_dir):
    from shiftguard.data import load

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    train = load("fashion-mnist", "train", root=data_dir)
    test = load("fashion-mnist", "test", root=data_dir)
    train_cls, test_cls = torch.tensor(TRAIN_CLASSES), torch.tensor(TEST_CLASSES)

    seen = torch.isin(train.labels, train_cls)
    pick = torch.randperm(int(seen.sum()), generator=g)[:4000]
    x_fit = train.images[seen][pick]
    y_fit = torch.searchsorted(train_cls, train.labels[seen][pick])
    net = TinyEmbeddingNet(len(TRAIN_CLASSES))
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for _ in range(2):
        order = torch.randperm(len(y_fit), generator=g)
        for i in range(0, len(order), 100):
            b = order[i : i + 100]
            loss = F.cross_entropy(net(x_fit[b]), y_fit[b])
            opt.zero_grad()
            loss.backward()
            opt.step()

    unseen = torch.isin(train.labels, test_cls)
    y_sup_all = torch.searchsorted(test_cls, train.labels[unseen])
    sup = torch.cat([torch.nonzero(y_sup_all == c).flatten()[:1000] for c in range(len(TEST_CLASSES))])
    x_sup, y_sup = train.images[unseen][sup], y_sup_all[sup]
    q = torch.isin(test.labels, test_cls)
    x_q, y_q = test.images[q][:1500], torch.searchsorted(test_cls, test.labels[q][:1500])

    net.eval()
    with torch.no_grad():
        emb_sup = net.embed(x_sup)
        queries = {"clean": net.embed(x_q)}
        for name, sev in SHIFTS:
            queries[f"{name}-{sev}"] = net.embed(_shift(x_q, name, sev))
    heads = {"NED": NED(k=20), "KNNVote": KNNVote(k=20), "OneNN": OneNN()}
    out = {}
    for hname, head in heads.items():
        head.fit(emb_sup, y_sup)
        for qname, emb in queries.items():
            p = head.predict_proba(emb)
            out[hname, qname] = (accuracy(p, y_q), ece(p, y_q))
    out["T"] = heads["NED"].temperature_
    print("\nNED evidence (accuracy, top-label ECE):")
    for qname in queries:
        print(f"  {qname:14s} " + "  ".join(f"{h}: {out[h, qname][0]:.3f} / {out[h, qname][1]:.3f}" for h in heads))
    return out


SETS = ["clean"] + [f"{n}-{s}" for n, s in SHIFTS]


@pytest.mark.parametrize("qset", SETS)
def test_ned_is_better_calibrated_than_one_nn_at_equal_or_better_accuracy(results, qset):
    ned_acc, ned_ece = results["NED", qset]
    nn_acc, nn_ece = results["OneNN", qset]
    assert ned_ece < nn_ece
    assert ned_acc >= nn_acc - 0.005


def test_ned_is_as_accurate_as_the_knn_vote_and_about_as_well_calibrated_on_clean_data(results):
    # [NED, Table 1] has NED's ECE far below kNN's; here both are 1-2% and which is lower depends on
    # the training run (see docs/heads_metrics.md), so only "comparable" is asserted.
    ned_acc, ned_ece = results["NED", "clean"]
    vote_acc, vote_ece = results["KNNVote", "clean"]
    assert ned_ece <= vote_ece + 0.02
    assert ned_acc >= vote_acc - 0.005
