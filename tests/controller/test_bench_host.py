from deskfleet.controller.bench.host import cpu_extensions, cpu_name, host_report

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 bmi2 vaes vpclmulqdq
"""

LUNAR_LAKE = "model name\t: Intel(R) Core(TM) Ultra 7 258V\nflags\t\t: avx avx2 avx_vnni sha_ni\n"


def test_the_cpu_is_named_by_its_first_processor() -> None:
    assert cpu_name(XEON) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert cpu_name(EPYC) == "AMD EPYC"
    assert cpu_name("") is None


def test_only_the_extensions_that_choose_kernels_are_listed_in_a_fixed_order() -> None:
    assert cpu_extensions(XEON) == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]
    assert cpu_extensions(EPYC) == ["avx2"]
    assert cpu_extensions(LUNAR_LAKE) == ["avx2", "avx_vnni"]
    assert cpu_extensions("model name\t: something without flags\n") == []


def test_the_report_describes_this_machine() -> None:
    report = host_report()
    assert set(report) == {"cpu", "cpu_extensions", "logical_cores", "allocator", "openvino", "python",
                           "load_avg_1m"}
    assert report["cpu"] and report["logical_cores"] >= 1
    assert report["allocator"] in {"jemalloc", "system"}
    assert isinstance(report["cpu_extensions"], list)
