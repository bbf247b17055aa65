"""``out=`` matrix products given an out tensor that shares elements with an operand
(``torch.mm(cache, w, out=cache)``): their CPU kernels (BLAS gemm / gemv) write the out
tensor while still reading the operand, so eager stores neither the product nor anything a
functional form computes (the exported program, run as is, matches eager; the functional
one returned the product, off eager by 2.3 to 5.2 on these programs, as torch's
``run_decompositions({})`` does). Refused; an out tensor
disjoint from the operands, or ``addmm``'s own ``self``, is rewritten exactly."""

import pytest
import torch
from torch import nn

from .functionalize_checks import _calls, functionalize_both_forms, refused_in_both_forms


class ProductIntoOperand(nn.Module):
    def __init__(self, product):
        super().__init__()
        self.product = product
        self.register_buffer("m", torch.eye(4) + 0.5)

    def forward(self, x):
        self.m.mul_(0.9)
        self.product(self.m, x)
        return self.m + 0


PRODUCTS_INTO_AN_OPERAND = {
    "mm": lambda m, x: torch.mm(m, x, out=m),
    "matmul": lambda m, x: torch.matmul(x, m, out=m),
    "addmm": lambda m, x: torch.addmm(x, m, x, out=m),
    "addmv": lambda m, x: torch.addmv(x[0], x, m[0], out=m[0]),
}


@pytest.mark.parametrize("name", PRODUCTS_INTO_AN_OPERAND)
def test_a_product_into_one_of_its_operands_is_refused(name):
    product = PRODUCTS_INTO_AN_OPERAND[name]
    error = refused_in_both_forms(lambda: ProductIntoOperand(product), _calls((4, 4)), "overlap")
    assert "shares elements with its operand" in error.reason


def test_a_product_into_a_disjoint_tensor_or_its_addend_is_exact():
    def disjoint_rows_and_addend(m, x):
        torch.mm(m[:2], x, out=m[2:])
        torch.addmm(m, x, x, out=m)

    functionalize_both_forms(lambda: ProductIntoOperand(disjoint_rows_and_addend),
                             _calls((4, 4)))
