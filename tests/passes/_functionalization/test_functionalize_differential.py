"""Property-based differential test: random small programs mixing in-place ops, views
taken before and after writes, and reads, over a few buffers and inputs. After
MarkMutableBuffers + InplaceToFunctional, both program forms must behave like eager over
4 successive calls (outputs, buffers and mutated inputs, exactly), or be rejected with a
typed error. The generator is tests/models/random_programs.py's;
``python -m benchmarks.fuzz_functionalize`` runs thousands of them
(tests/benchmarks/test_fuzz_functionalize.py checks that command)."""

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.models.random_programs import ALL_WRITES, check_program, generate_program


class DataChooser:
    """The fuzz generator's choices, drawn by hypothesis (so failures shrink)."""

    def __init__(self, data):
        self._data = data

    def choice(self, options):
        return self._data.draw(st.sampled_from(list(options)))

    def integer(self, low, high):
        return self._data.draw(st.integers(low, high))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_functionalized_programs_behave_like_eager(data):
    steps = generate_program(DataChooser(data), max_steps=6, writes=ALL_WRITES)
    outcome = check_program(steps, seed=len(steps))
    event(outcome.split(":")[0])
    assert not outcome.startswith(("mismatch", "crash")), f"{outcome}\nsteps: {steps}"


def test_regression_write_through_transpose_keeps_eager_memory_layout():
    # Found by the fuzzer: after masked_fill_ through x.t(), x itself was a transposed
    # copy, so x.sum() rounded differently from eager (1 ulp). The root keeps its layout.
    steps = [("write", "b0", "add_", ("xslice",)), ("read", "x"),
             ("view", "h5", "x", (("t",),)), ("write", "h5", "masked_fill_", ("scalar",)),
             ("write", "h5", "setitem", ("xsum",))]
    assert check_program(steps, seed=301866) == "transformed"


def test_regression_export_graph_with_a_missing_use_and_a_no_grad_write():
    # Found by the fuzzer: export left full_like_1 out of index_add_'s users (next to a
    # no_grad region), and re-wiring it failed inside FX; the region's operand then had to
    # outlive the in-place node it reads.
    steps = [("return_view", "b1"), ("write", "x", "lerp_", ("xsum",)),
             ("write", "b2", "index_add_", ("xslice",)), ("return_view", "h"),
             ("return_view", "m"), ("write", "b2", "nograd_add_", ("scalar",)),
             ("view", "h6", "h", (("select", 0, 4), ("unsqueeze", 0))), ("temp", "h7", "h6")]
    assert check_program(steps, seed=2029) == "transformed"


def test_writes_to_a_frozen_parameter_through_views_are_functionalized():
    # The generator's frozen parameter "p": written through a strided slice and whole, read
    # and returned as a view; torch's functionalization makes these PARAMETER_MUTATIONs.
    steps = [("view", "h0", "p", (("slice", 0, 1, 5, 2),)), ("write", "h0", "add_", ("xsum",)),
             ("read", "p"), ("write", "p", "mul_", ("handle", "y")), ("return_view", "p")]
    assert check_program(steps, seed=5) == "transformed"


def test_regression_in_place_product_reading_the_tensor_it_writes_is_refused():
    # Found by the fuzzer once it drew writes reading their right-hand side as an operand:
    # x.addmm_(x, w) has BLAS read x while it writes x, so eager's x is off the product the
    # functional program computed by 2.6 (and, written on into the parameter, by 1.8).
    seed_52037 = [("view", "h0", "p", (("as_strided", (2, 2), (1, 1), 0),)),
                  ("write", "x", "addmm_", ("xslice",)),
                  ("write", "b1", "masked_fill_", ("scalar",)), ("return_view", "b1"),
                  ("read", "h"), ("write", "h", "nograd_add_", ("handle", "h"))]
    seed_52048 = [("write", "b0", "mul_", ("scalar",)), ("write", "b0", "add_", ("xslice",)),
                  ("return_view", "b0"), ("write", "x", "addmm_", ("handle", "x")),
                  ("view", "h4", "x", (("slice", 1, 0, 2, 1), ("einsum", "ab->ba"),
                                       ("movedim", 1, 0))),
                  ("write", "p", "put_acc", ("xslice",))]
    assert check_program(seed_52037, seed=52037) == "rejected: overlap"
    assert check_program(seed_52048, seed=52048) == "rejected: overlap"
