"""Per-FedAvg's equations on hand-made quadratics f(w) = 1/2 w'Aw - b'w (grad = Aw - b, Hessian = A), where the MAML
gradient (I - alpha A) grad f(w - alpha grad f(w)) has a closed form."""
import torch

from pflkit_perfedavg.equations import hessian_vector_product, hf_direction, inner_step, meta_step

A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
B = torch.tensor([1.0, -1.0], dtype=torch.float64)
A2 = torch.tensor([[4.0]], dtype=torch.float64)  # a second parameter tensor with its own quadratic
B2 = torch.tensor([2.0], dtype=torch.float64)


def grad(point):
    return [A @ point[0] - B, A2 @ point[1] - B2]


def test_inner_step_is_one_gradient_step():
    w = [torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)]
    got = inner_step(w, grad(w), 0.1)
    assert torch.allclose(got[0], torch.tensor([1.0 - 0.1 * 4.0, 2.0 - 0.1 * 6.0], dtype=torch.float64))
    assert torch.allclose(got[1], torch.tensor([0.5 - 0.1 * 0.0], dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(inner_step(w, grad(w), 0.0), w))


def test_central_differences_give_the_exact_hessian_vector_product_on_a_quadratic():
    w = [torch.tensor([0.3, -0.7], dtype=torch.float64), torch.tensor([1.5], dtype=torch.float64)]
    v = [torch.tensor([2.0, 1.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)]
    hv = hessian_vector_product(grad, w, v, 1e-3)
    assert torch.allclose(hv[0], A @ v[0], atol=1e-9) and torch.allclose(hv[1], A2 @ v[1], atol=1e-9)


def test_hessian_free_direction_is_the_maml_gradient_and_first_order_drops_the_hessian():
    alpha, beta = 0.1, 0.5
    w = [torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)]
    w_tilde = inner_step(w, grad(w), alpha)
    outer = grad(w_tilde)  # FO direction
    hv = hessian_vector_product(grad, w, outer, 1e-3)
    direction = hf_direction(outer, hv, alpha)
    # closed form: (I - alpha A) (A (w - alpha (A w - b)) - b)
    eye = torch.eye(2, dtype=torch.float64)
    want = (eye - alpha * A) @ (A @ (w[0] - alpha * (A @ w[0] - B)) - B)
    assert torch.allclose(direction[0], want, atol=1e-9)
    assert torch.allclose(direction[1], (1 - alpha * A2[0]) * (A2 @ w_tilde[1] - B2), atol=1e-9)
    stepped = meta_step(w, direction, beta)
    assert torch.allclose(stepped[0], w[0] - beta * want, atol=1e-9)
    assert not torch.allclose(outer[0], want)  # FO differs from the exact gradient by the Hessian term
