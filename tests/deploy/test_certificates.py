"""csi_local.ops.x509 and doctor's snapshot-metadata certificate check on
certificates made at test time by the host's openssl (`req -x509`, `ca` for
chosen dates, and the commands of docs/snapshot-metadata.md): UTCTime and
GeneralizedTime, RSA and EC keys, a chain (its first block, the leaf), and
what is no certificate. The dates are compared with what openssl itself
prints (`x509 -dates`). (tests/unit/test_x509.py covers the DER reader's
refusals with hand-made encodings: unit tests start no process.)"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from csi_local.ops import doctor
from csi_local.ops.x509 import (
    CertificateError,
    Validity,
    first_pem_certificate,
    pem_certificate,
)
from tests.deploy._deploy import REPO
from tests.unit.conftest import FakeRunner

SM_DOCS = REPO / "docs" / "snapshot-metadata.md"


def _sh_block(text: str, marker: str) -> str:
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if marker in b]
    return str(block)


def pem_validity(text: str) -> Validity:
    """The validity of a PEM's first certificate: the half of pem_certificate
    these tests compare with openssl's."""
    return pem_certificate(text)[0]


def openssl(*argv: str, cwd: Path) -> str:
    exe = shutil.which("openssl")
    assert exe, "openssl not found (apt-get install openssl): these tests need it"
    r = subprocess.run([exe, *argv], cwd=cwd, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, f"openssl {' '.join(argv)}: {r.stderr}"
    return r.stdout


def self_signed(d: Path, name: str, *key: str, days: str = "30") -> str:
    """`openssl req -x509`, as docs/snapshot-metadata.md makes its CA."""
    openssl("req", "-x509", "-newkey", *key, "-nodes", "-days", days, "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=d)
    return (d / f"{name}.crt").read_text()


def with_dates(d: Path, name: str, start: str, end: str) -> str:
    """A certificate valid from `start` to `end` (YYYYMMDDHHMMSSZ; openssl
    writes UTCTime for years 1950 to 2049, GeneralizedTime otherwise)."""
    (d / "ca").mkdir(exist_ok=True)
    (d / "ca/index.txt").touch()
    (d / "ca/serial").write_text("01\n")
    (d / "ca.cnf").write_text("[ca]\ndefault_ca = d\n[d]\ndatabase = ca/index.txt\n"
                              "new_certs_dir = ca\nserial = ca/serial\ndefault_md = sha256\n"
                              "policy = p\nunique_subject = no\n[p]\ncommonName = supplied\n")
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    openssl("ca", "-batch", "-config", "ca.cnf", "-selfsign", "-keyfile", f"{name}.key",
            "-in", f"{name}.csr", "-startdate", start, "-enddate", end, "-notext",
            "-out", f"{name}.crt", cwd=d)
    return (d / f"{name}.crt").read_text()


def openssl_dates(d: Path, pem: str) -> tuple[datetime, datetime]:
    (d / "probe.crt").write_text(pem)
    out = openssl("x509", "-in", "probe.crt", "-noout", "-startdate", "-enddate", cwd=d)
    got = dict(line.split("=", 1) for line in out.splitlines())

    def parse(text: str) -> datetime:
        return datetime.strptime(" ".join(text.split()), "%b %d %H:%M:%S %Y GMT").replace(
            tzinfo=UTC)

    return parse(got["notBefore"]), parse(got["notAfter"])


def test_utc_time(tmp_path: Path) -> None:
    pem = with_dates(tmp_path, "old", "20200101000000Z", "20210102030405Z")
    v = pem_validity(pem)
    assert v.not_before == datetime(2020, 1, 1, tzinfo=UTC)
    assert v.not_after == datetime(2021, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert (v.not_before, v.not_after) == openssl_dates(tmp_path, pem)


def test_generalized_time(tmp_path: Path) -> None:
    """From 2050 on, RFC 5280 times are GeneralizedTime; 1950 to 2049 UTCTime
    (YY below 50 is 20YY, from 50 it is 19YY)."""
    pem = with_dates(tmp_path, "far", "19700101000000Z", "20510718012624Z")
    assert b"\x18\x0f20510718012624Z" in first_pem_certificate(pem)
    assert b"\x17\x0d700101000000Z" in first_pem_certificate(pem)
    v = pem_validity(pem)
    assert v.not_before == datetime(1970, 1, 1, tzinfo=UTC)
    assert v.not_after == datetime(2051, 7, 18, 1, 26, 24, tzinfo=UTC)
    assert (v.not_before, v.not_after) == openssl_dates(tmp_path, pem)


@pytest.mark.parametrize("key", [("rsa:3072",), ("ec", "-pkeyopt", "ec_paramgen_curve:P-256")])
def test_req_x509_as_the_docs_make_it(tmp_path: Path, key: tuple[str, ...]) -> None:
    """RSA 3072 (the docs' key: long-form lengths) and EC, valid for 10 years."""
    pem = self_signed(tmp_path, "ca", *key, days="3650")
    assert (pem_validity(pem).not_before, pem_validity(pem).not_after) == (
        openssl_dates(tmp_path, pem))


def test_a_chain_is_read_by_its_first_certificate(tmp_path: Path) -> None:
    leaf = with_dates(tmp_path, "leaf", "20240101000000Z", "20240301000000Z")
    ca = self_signed(tmp_path, "ca", "ec", "-pkeyopt", "ec_paramgen_curve:P-256")
    assert pem_validity(leaf + ca).not_after == datetime(2024, 3, 1, tzinfo=UTC)
    assert pem_validity(ca + leaf) == pem_validity(ca)
    # a key before the certificate (a combined file) is skipped
    key = (tmp_path / "leaf.key").read_text()
    assert pem_validity(key + leaf) == pem_validity(leaf)


def test_not_a_certificate(tmp_path: Path) -> None:
    key = self_signed(tmp_path, "k", "ec", "-pkeyopt", "ec_paramgen_curve:P-256")
    der = first_pem_certificate(key)
    for text, why in (((tmp_path / "k.key").read_text(), "no PEM CERTIFICATE block"),
                      (key.replace("\n", "\n!", 2), "not valid base64"),
                      (key.replace(key.splitlines()[3], key.splitlines()[3][:8]), "base64|"
                       "runs past|truncated|expected"),
                      ("-----BEGIN CERTIFICATE-----\n" + base64.b64encode(der[:60]).decode()
                       + "\n-----END CERTIFICATE-----\n", "runs past its container")):
        with pytest.raises(CertificateError, match=why):
            pem_validity(text)


# doctor's check, on the certificates the docs make ------------------------------------

def _doctor(root: Path, now: datetime) -> doctor.Check:
    system = doctor.System(FakeRunner(), str(root), clock=lambda: now)
    return doctor.check_tls_certificate(system, CERT)


CERT = "/etc/csi-snapshot-metadata/tls/tls.crt"
SM_ADDRESS = yaml.safe_load((REPO / "deploy/kubernetes/components/snapshot-metadata/"
                             "snapshotmetadataservice.yaml").read_text())["spec"]["address"]


def test_doctor_checks_the_address_the_example_advertises() -> None:
    """doctor's default is the shipped SnapshotMetadataService's spec.address."""
    assert doctor.SNAPSHOT_METADATA_ADDRESS == SM_ADDRESS


def test_doctor_on_the_docs_certificate(tmp_path: Path) -> None:
    """The openssl commands of docs/snapshot-metadata.md make tls.crt, valid
    for a year: ok with its date; 10 days before its end a warning with the
    date; after it a failure. A chain file (tls.crt then ca.crt) is the
    leaf's date, not the CA's (ten years)."""
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", _sh_block(SM_DOCS.read_text(),
                                                                    "openssl req -x509")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    leaf = (tmp_path / "tls.crt").read_text()
    _, not_after = openssl_dates(tmp_path, leaf)
    root = tmp_path / "root"
    (root / CERT[1:]).parent.mkdir(parents=True)
    (root / CERT[1:]).write_text(leaf + (tmp_path / "ca.crt").read_text())
    day = f"{not_after:%Y-%m-%d %H:%M:%S} UTC"

    got = _doctor(root, not_after - timedelta(days=200))
    host = SM_ADDRESS.rpartition(":")[0]
    assert got == doctor.Check("snapshot-metadata TLS certificate", doctor.OK,
                               f"{CERT} for {host}, valid until {day} (200 days)")
    # Its names as openssl prints them; an address none of them is for fails.
    names = openssl("x509", "-in", "tls.crt", "-noout", "-ext", "subjectAltName",
                    cwd=tmp_path).splitlines()[-1].strip()
    assert names == f"DNS:{host}, DNS:{host}.cluster.local, DNS:{host.removesuffix('.svc')}"
    system = doctor.System(FakeRunner(), str(root),
                           clock=lambda: not_after - timedelta(days=200))
    got = doctor.check_tls_certificate(system, CERT, address="sm.example.org:443")
    assert (got.status, got.message.split(": ")[1]) == (
        doctor.FAIL, f"its subject alternative names are {names}, and backup clients that "
        "dial the address refuse the sidecar")
    got = _doctor(root, not_after - timedelta(days=10, hours=1))
    assert (got.status, got.message) == (doctor.WARN, f"{CERT} expires on {day}, in 10 day(s)")
    assert "cert-manager" in got.fix
    got = _doctor(root, not_after + timedelta(seconds=1))
    assert (got.status, got.message) == (
        doctor.FAIL, f"{CERT} expired on {day}: backup clients refuse the sidecar")
