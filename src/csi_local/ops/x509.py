"""The validity period and subject alternative names of an X.509
certificate (RFC 5280), read from PEM.

doctor needs no more than notBefore, notAfter and the names (DNS names, IP
addresses) clients check the server's name against, of the snapshot-metadata
sidecar's certificate, so this is a small, strict DER reader for exactly
that path through the structure, with no new dependency in the image
(Python's ssl module has no public call that decodes a certificate file,
and a cryptography wheel would add megabytes for two dates and a list):

    Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm, signature }
    TBSCertificate ::= SEQUENCE { [0] version OPTIONAL, serialNumber INTEGER,
                                  signature SEQUENCE, issuer SEQUENCE,
                                  validity SEQUENCE { notBefore Time, notAfter Time },
                                  subject SEQUENCE, subjectPublicKeyInfo SEQUENCE,
                                  [1] issuerUniqueID OPTIONAL, [2] subjectUniqueID OPTIONAL,
                                  [3] extensions SEQUENCE OF Extension OPTIONAL }
    Time ::= UTCTime (YYMMDDHHMMSSZ) | GeneralizedTime (YYYYMMDDHHMMSSZ)
    Extension ::= SEQUENCE { extnID OID, critical BOOLEAN DEFAULT FALSE,
                             extnValue OCTET STRING }
    subjectAltName (2.5.29.17) ::= SEQUENCE OF GeneralName,
        [2] dNSName IA5String | [7] iPAddress (4 or 16 bytes) | others (skipped)

Strict: definite, minimal lengths only (DER), every element inside its
parent, times in RFC 5280's one form (seconds, Z, no fractions). Anything
else is a CertificateError: doctor reports a file it cannot read as it is
rather than guess a date. The first CERTIFICATE block of a chain is the leaf
(the server's own certificate, as a TLS server sends it first).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from dataclasses import dataclass
from datetime import UTC, datetime

_PEM = re.compile(r"-----BEGIN CERTIFICATE-----\r?\n(.*?)-----END CERTIFICATE-----", re.S)
_SEQUENCE, _INTEGER, _VERSION = 0x30, 0x02, 0xA0
_UTC_TIME, _GENERALIZED_TIME = 0x17, 0x18
_EXTENSIONS, _OID, _BOOLEAN, _OCTET_STRING = 0xA3, 0x06, 0x01, 0x04
_SAN_OID = bytes([0x55, 0x1D, 0x11])  # 2.5.29.17
_DNS_NAME, _IP_ADDRESS = 0x82, 0x87  # GeneralName's [2] and [7], IMPLICIT primitive


class CertificateError(ValueError):
    """Not a certificate this reader can take; the message says why."""


@dataclass(frozen=True)
class Validity:
    not_before: datetime  # aware, UTC
    not_after: datetime


def first_pem_certificate(text: str) -> bytes:
    """The DER bytes of the first CERTIFICATE block of `text`."""
    match = _PEM.search(text)
    if match is None:
        raise CertificateError("no PEM CERTIFICATE block")
    body = "".join(match.group(1).split())
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise CertificateError("the CERTIFICATE block is not valid base64") from None


def _element(der: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """(tag, start of content, end of content) of the DER element at `pos`,
    which must lie within `end`."""
    if pos + 2 > end:
        raise CertificateError(f"truncated at byte {pos}")
    tag, first = der[pos], der[pos + 1]
    if tag & 0x1F == 0x1F:
        raise CertificateError(f"unexpected high tag number at byte {pos}")
    pos += 2
    if first < 0x80:
        length = first
    elif first == 0x80:
        raise CertificateError(f"indefinite length at byte {pos - 2} (BER, not DER)")
    else:
        count = first & 0x7F
        if count > 4 or pos + count > end:
            raise CertificateError(f"bad length at byte {pos - 2}")
        raw = der[pos:pos + count]
        length = int.from_bytes(raw, "big")
        if raw[0] == 0 or length < 0x80:
            raise CertificateError(f"non-minimal length at byte {pos - 2} (not DER)")
        pos += count
    if pos + length > end:
        raise CertificateError(f"element at byte {pos} runs past its container")
    return tag, pos, pos + length


def _expect(der: bytes, pos: int, end: int, tag: int, what: str) -> tuple[int, int]:
    got, start, stop = _element(der, pos, end)
    if got != tag:
        raise CertificateError(f"expected {what} (tag 0x{tag:02x}) at byte {pos}, "
                               f"found tag 0x{got:02x}")
    return start, stop


def _time(der: bytes, pos: int, end: int) -> tuple[datetime, int]:
    tag, start, stop = _element(der, pos, end)
    text = der[start:stop].decode("ascii", errors="replace")
    if tag == _UTC_TIME and re.fullmatch(r"[0-9]{12}Z", text):
        year = int(text[:2])
        # RFC 5280 4.1.2.5.1: YY >= 50 is 19YY, else 20YY
        year += 1900 if year >= 50 else 2000
        rest = text[2:]
    elif tag == _GENERALIZED_TIME and re.fullmatch(r"[0-9]{14}Z", text):
        year, rest = int(text[:4]), text[4:]
    else:
        raise CertificateError(f"not an RFC 5280 time at byte {pos}: tag 0x{tag:02x} "
                               f"{text!r}")
    try:
        when = datetime(year, int(rest[0:2]), int(rest[2:4]), int(rest[4:6]), int(rest[6:8]),
                        int(rest[8:10]), tzinfo=UTC)
    except ValueError as err:
        raise CertificateError(f"invalid time {text!r}: {err}") from None
    return when, stop


@dataclass(frozen=True)
class AltNames:
    """The subject alternative names a TLS client checks the server's name
    against (RFC 6125; Go's crypto/tls, as the sidecar's clients are, looks
    at nothing else: never the subject's common name)."""

    dns: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()  # as ipaddress prints them

    def covers(self, host: str) -> bool:
        """Whether a client dialing `host` accepts these names: an IP address
        among `ips`; a DNS name equal to one of `dns` (case aside, a final dot
        aside) or matched by a wildcard one ("*.example.org": exactly one
        label in place of the star, the leftmost)."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None:
            return str(ip) in self.ips
        host = host.rstrip(".").lower()
        label, _, parent = host.partition(".")
        for name in (n.rstrip(".").lower() for n in self.dns):
            if name == host or (name.startswith("*.") and label and name[2:] == parent):
                return True
        return False


def der_certificate(der: bytes) -> tuple[Validity, AltNames]:
    """notBefore and notAfter of the DER certificate `der`, and its subject
    alternative names (none when it has no such extension)."""
    start, stop = _expect(der, 0, len(der), _SEQUENCE, "Certificate SEQUENCE")
    if stop != len(der):
        raise CertificateError(f"{len(der) - stop} byte(s) after the certificate")
    pos, tbs_end = _expect(der, start, stop, _SEQUENCE, "TBSCertificate SEQUENCE")
    tag, _, after = _element(der, pos, tbs_end)
    if tag == _VERSION:
        pos = after
    for tag, what in ((_INTEGER, "serialNumber"), (_SEQUENCE, "signature"),
                      (_SEQUENCE, "issuer")):
        pos = _expect(der, pos, tbs_end, tag, what)[1]
    pos, validity_end = _expect(der, pos, tbs_end, _SEQUENCE, "validity SEQUENCE")
    not_before, pos = _time(der, pos, validity_end)
    not_after, pos = _time(der, pos, validity_end)
    if pos != validity_end:
        raise CertificateError("more than two times in the validity SEQUENCE")
    for tag, what in ((_SEQUENCE, "subject"), (_SEQUENCE, "subjectPublicKeyInfo")):
        pos = _expect(der, pos, tbs_end, tag, what)[1]
    names = AltNames()
    while pos < tbs_end:  # the unique IDs (v2), then the extensions (v3)
        tag, start, pos = _element(der, pos, tbs_end)
        if tag == _EXTENSIONS:
            names = _extensions(der, start, pos)
    return Validity(not_before, not_after), names


def _extensions(der: bytes, pos: int, end: int) -> AltNames:
    pos, end = _expect(der, pos, end, _SEQUENCE, "extensions SEQUENCE")
    while pos < end:
        ext, ext_end = _expect(der, pos, end, _SEQUENCE, "Extension SEQUENCE")
        oid_start, at = _expect(der, ext, ext_end, _OID, "extnID")
        oid = der[oid_start:at]
        tag, _, after = _element(der, at, ext_end)
        if tag == _BOOLEAN:  # critical
            at = after
        value, value_end = _expect(der, at, ext_end, _OCTET_STRING, "extnValue")
        if oid == _SAN_OID:
            return _general_names(der, value, value_end)
        pos = ext_end
    return AltNames()


def _general_names(der: bytes, pos: int, end: int) -> AltNames:
    pos, end = _expect(der, pos, end, _SEQUENCE, "subjectAltName SEQUENCE")
    dns: list[str] = []
    ips: list[str] = []
    while pos < end:
        tag, start, pos = _element(der, pos, end)
        raw = der[start:pos]
        if tag == _DNS_NAME:
            dns.append(raw.decode("ascii", errors="replace"))
        elif tag == _IP_ADDRESS:
            if len(raw) not in (4, 16):
                raise CertificateError(f"an iPAddress of {len(raw)} bytes at byte {start}")
            ips.append(str(ipaddress.ip_address(raw)))
    return AltNames(tuple(dns), tuple(ips))


def pem_certificate(text: str) -> tuple[Validity, AltNames]:
    """The validity and subject alternative names of the first certificate of
    the PEM `text` (a chain's leaf)."""
    return der_certificate(first_pem_certificate(text))
