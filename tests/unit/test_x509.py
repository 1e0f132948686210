"""csi_local.ops.x509's DER reader on hand-made encodings: the path to the
validity, its two time forms, and every refusal (BER lengths, truncation,
trailing bytes, other tags, malformed times). Certificates made by openssl
are read in tests/deploy/test_certificates.py (unit tests start no process)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest

from csi_local.ops.x509 import (
    AltNames,
    CertificateError,
    Validity,
    der_certificate,
    first_pem_certificate,
    pem_certificate,
)


# The reader's two halves and its PEM form, which only these tests ask for
# apart (doctor reads both at once, pem_certificate).
def validity(der: bytes) -> Validity:
    return der_certificate(der)[0]


def alt_names(der: bytes) -> AltNames:
    return der_certificate(der)[1]


def pem_validity(text: str) -> Validity:
    return pem_certificate(text)[0]


def tlv(tag: int, content: bytes) -> bytes:
    n = len(content)
    if n < 0x80:
        return bytes([tag, n]) + content
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(raw)]) + raw + content


def seq(*parts: bytes) -> bytes:
    return tlv(0x30, b"".join(parts))


UTC_2021 = tlv(0x17, b"210102030405Z")
GEN_2051 = tlv(0x18, b"20510718012624Z")
NAME = seq(tlv(0x31, seq(tlv(0x06, b"\x55\x04\x03"), tlv(0x0C, b"x" * 200))))  # long form


def cert(times: bytes = UTC_2021 + GEN_2051, *, version: bool = True,
         extensions: bytes = b"") -> bytes:
    """`extensions`: the [3] element as it is (after a subject unique ID, as
    v2 allows, when given)."""
    tbs = seq(*([tlv(0xA0, tlv(0x02, b"\x02"))] if version else []), tlv(0x02, b"\x01"),
              seq(tlv(0x06, b"\x2a\x86\x48\xce\x3d\x04\x03\x02")), NAME, seq(times), NAME,
              seq(b"\x00" * 10), extensions)
    return seq(tbs, seq(tlv(0x06, b"\x2a")), tlv(0x03, b"\x00\x01"))


def san(*names: bytes, critical: bool = False) -> bytes:
    """A subjectAltName Extension of GeneralNames `names` (dns(), ip(), ...)."""
    return seq(tlv(0x06, b"\x55\x1d\x11"), *([tlv(0x01, b"\xff")] if critical else []),
               tlv(0x04, seq(*names)))


def dns(name: str) -> bytes:
    return tlv(0x82, name.encode())


def ip(raw: bytes) -> bytes:
    return tlv(0x87, raw)


# basicConstraints (CA:FALSE), critical: an extension other than the names
BASIC = seq(tlv(0x06, b"\x55\x1d\x13"), tlv(0x01, b"\xff"), tlv(0x04, seq()))


def extensions(*exts: bytes) -> bytes:
    return tlv(0xA3, seq(*exts))


def pem(der: bytes, label: str = "CERTIFICATE") -> str:
    return (f"-----BEGIN {label}-----\n" + base64.encodebytes(der).decode()
            + f"-----END {label}-----\n")


def test_both_time_forms() -> None:
    v = validity(cert())
    assert v.not_before == datetime(2021, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert v.not_after == datetime(2051, 7, 18, 1, 26, 24, tzinfo=UTC)
    # v1 certificates have no [0] version
    assert validity(cert(version=False)) == v


def test_utc_time_centuries() -> None:
    """RFC 5280: YY from 50 is 19YY, below 50 is 20YY."""
    got = validity(cert(tlv(0x17, b"500101000000Z") + tlv(0x17, b"491231235959Z")))
    assert (got.not_before.year, got.not_after.year) == (1950, 2049)


def test_pem_first_block_and_whitespace() -> None:
    first, second = cert(), cert(UTC_2021 + tlv(0x17, b"300101000000Z"))
    text = ("junk\n" + pem(b"\x01\x02", "PRIVATE KEY") + pem(first).replace("\n", "\r\n")
            + pem(second))
    assert first_pem_certificate(text) == first
    assert pem_validity(text).not_after.year == 2051


def test_subject_alt_names() -> None:
    """DNS names and IP addresses, among other extensions and other kinds of
    name (an rfc822Name, a directoryName); none without the extension."""
    der = cert(extensions=extensions(BASIC, san(
        dns("svc.ns.svc"), tlv(0x81, b"a@b.c"), dns("*.ns.svc"), ip(b"\x0a\x00\x00\x01"),
        tlv(0xA4, NAME), ip(bytes(15) + b"\x01"), critical=True)))
    assert alt_names(der) == AltNames(("svc.ns.svc", "*.ns.svc"), ("10.0.0.1", "::1"))
    assert validity(der) == validity(cert())
    assert pem_certificate(pem(der)) == (validity(cert()), alt_names(der))
    assert alt_names(cert()) == AltNames()
    assert alt_names(cert(extensions=extensions(BASIC))) == AltNames()
    # A v2 subject unique ID before the extensions is stepped over.
    assert alt_names(cert(extensions=tlv(0x82, b"\x00\x01") + extensions(san(dns("x"))))) \
        == AltNames(("x",))


@pytest.mark.parametrize(("host", "covered"), [
    ("svc.ns.svc", True), ("SVC.ns.svc.", True), ("other.ns.svc", True),  # by the wildcard
    ("a.b.ns.svc", False), ("ns.svc", False), ("svc.ns.svc.cluster.local", False),
    ("10.0.0.1", True), ("10.0.0.2", False), ("::1", True), ("0:0::1", True),
    ("svc", False)])
def test_which_hosts_the_names_cover(host: str, covered: bool) -> None:
    """As a TLS client checks the server's name: a wildcard stands for one
    leftmost label, never more, never none; an IP address only matches an
    iPAddress name, never a DNS one."""
    names = AltNames(("svc.ns.svc", "*.ns.svc", "10.0.0.2.example"), ("10.0.0.1", "::1"))
    assert names.covers(host) is covered


@pytest.mark.parametrize(("der", "why"), [
    (b"", "truncated"),
    (cert()[:-1], "runs past its container"),
    (cert() + b"\x00", "1 byte\\(s\\) after the certificate"),
    (b"\x30\x80" + cert()[2:], "indefinite length"),
    (b"\x30\x81\x05" + seq(b"\x02\x01\x01")[:5], "non-minimal length"),
    (b"\x30\x82\x00\x05" + b"\x02\x01\x01\x30\x00", "non-minimal length"),
    (tlv(0x04, b"abc"), "expected Certificate SEQUENCE"),
    (b"\x1f\x01\x00", "high tag number"),
    (seq(seq(tlv(0x02, b"\x01"), tlv(0x02, b"\x01"))), "expected signature"),
    (seq(seq(tlv(0x02, b"\x01"))), "truncated"),
    (cert(UTC_2021), "truncated"),
    (cert(UTC_2021 + GEN_2051 + UTC_2021), "more than two times"),
    (cert(tlv(0x17, b"210102030405+0100") + GEN_2051), "not an RFC 5280 time"),
    (cert(tlv(0x18, b"20510718012624.5Z") + GEN_2051), "not an RFC 5280 time"),
    (cert(tlv(0x17, b"211302030405Z") + GEN_2051), "invalid time"),  # month 13
    (cert(tlv(0x13, b"210102030405Z") + GEN_2051), "not an RFC 5280 time"),
    (cert(extensions=extensions(san(ip(b"\x0a\x00\x01")))), "an iPAddress of 3 bytes"),
    (cert(extensions=extensions(seq(tlv(0x04, b"")))), "expected extnID"),
    (cert(extensions=extensions(seq(tlv(0x06, b"\x55\x1d\x11"), tlv(0x04, dns("x"))))),
     "expected subjectAltName SEQUENCE"),
])
def test_refused(der: bytes, why: str) -> None:
    with pytest.raises(CertificateError, match=why):
        validity(der)


@pytest.mark.parametrize(("text", "why"), [
    ("", "no PEM CERTIFICATE block"),
    (pem(cert(), "PRIVATE KEY"), "no PEM CERTIFICATE block"),
    ("-----BEGIN CERTIFICATE-----\nMII*\n-----END CERTIFICATE-----\n", "not valid base64"),
    ("-----BEGIN CERTIFICATE-----\nMIIB\n", "no PEM CERTIFICATE block"),  # no end line
])
def test_refused_pem(text: str, why: str) -> None:
    with pytest.raises(CertificateError, match=why):
        pem_validity(text)
