"""feature_reduction="pick_last" on right-padded sequences (a Hugging Face sequence classifier):
the diagonal GGN and the probit predictive vs the exact ones (float64)."""

import json

import torch
from laplace import Laplace as LTLaplace
from torch import nn
from torch.utils.data import DataLoader

from multiscale_jac.laplace import Laplace as MJLaplace

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
V, L, H, C, N = 11, 6, 5, 3, 24


class SeqClassifier(nn.Module):  # score() at every position, logits at the last real token
    def __init__(self):
        super().__init__()
        self.emb, self.body, self.score = nn.Embedding(V, H), nn.Linear(H, H), nn.Linear(H, C)

    def features(self, batch):  # (B, L, H); pads differ from real tokens
        return torch.tanh(self.body(torch.cumsum(self.emb(batch["input_ids"]), 1)))

    def forward(self, batch):
        last = batch["attention_mask"].sum(1) - 1
        return self.score(self.features(batch))[torch.arange(len(last)), last]


torch.manual_seed(0)
lengths = torch.randint(2, L + 1, (N,))
lengths[:4] = torch.tensor([2, 3, 4, L])
mask = (torch.arange(L)[None] < lengths[:, None]).long()
ids, labels = torch.randint(1, V, (N, L)) * mask, torch.randint(0, C, (N,))  # pad token 0
data = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(N)]
model, test = SeqClassifier(), {"input_ids": ids[:4], "attention_mask": mask[:4]}  # 3 padded

# exact GGN w.r.t. score.(weight, bias): J_n = [phi_n^T (x) I_C, I_C], phi_n at the last real token
with torch.no_grad():
    phi = model.features({"input_ids": ids})
    p = model({"input_ids": ids, "attention_mask": mask}).softmax(-1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None]


def jac(feats):
    eye = torch.eye(C).expand(len(feats), C, C)
    return torch.cat([torch.einsum("nh,cd->ncdh", feats, eye[0]).flatten(2), eye], 2)


def ggn(J):
    return torch.einsum("ncp,ncd,ndq->pq", J, lam, J)


J_real, J_last = jac(phi[torch.arange(N), lengths - 1]), jac(phi[:, -1])
H_exact = ggn(J_real)
Sigma = torch.linalg.inv(H_exact + torch.eye(len(H_exact)))  # prior precision 1
var = torch.einsum("ncp,pq,ncq->nc", J_real[:4], Sigma, J_real[:4])
with torch.no_grad():  # laplace-torch's probit predictive, by hand
    probit = (model(test) / (1 + torch.pi / 8 * var).sqrt()).softmax(-1)


def rel(a, b):
    return float((torch.as_tensor(a).detach() - b).norm() / b.norm())


out = {}
kw = dict(subset_of_weights="last_layer", feature_reduction="pick_last", last_layer_name="score")
for name, cls in [("lt", LTLaplace), ("mj", MJLaplace)]:
    la = cls(model, "classification", hessian_structure="diag", **kw)
    la.fit(DataLoader(data, batch_size=8))
    out[f"{name}_diag_rel_err"] = rel(la.H, H_exact.diag())
    out[f"{name}_diag_rel_err_vs_position_-1"] = rel(la.H, ggn(J_last).diag())
    la = cls(model, "classification", hessian_structure="full", **kw)
    la.fit(DataLoader(data, batch_size=8))
    out[f"{name}_full_rel_err"] = rel(la.H, H_exact)
    out[f"{name}_probit_rel_err"] = rel(la(test, pred_type="glm", link_approx="probit"), probit)
print(json.dumps(out))
