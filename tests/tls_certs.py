"""Test certificates (the `cryptography` package): a CA, a server/client certificate it signed for
127.0.0.1 / localhost (and an extra DNS name), and a second, unrelated CA. Used by tests/protocol/test_tls.py
and the TLS variant of tests/faults/test_fuzz_buffer.py."""
import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "scalerl.test"     # a SAN of the certificate that is not the dialed host


def _key():
  return ec.generate_private_key(ec.SECP256R1())


def _name(cn):
  return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn):
  key = _key()
  now = datetime.datetime.now(datetime.timezone.utc)
  cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(key, hashes.SHA256()))
  return key, cert


def _pem(cert):
  return cert.public_bytes(serialization.Encoding.PEM)


def make_certs(d) -> dict:
  """Writes ca.pem, cert.pem, key.pem (signed by ca), other_ca.pem into `d`; returns their paths."""
  os.makedirs(d, exist_ok=True)
  ca_key, ca = _ca("scalerl test CA")
  _, other = _ca("some other CA")
  key = _key()
  now = datetime.datetime.now(datetime.timezone.utc)
  san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.DNSName(SERVER_NAME),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
  cert = (x509.CertificateBuilder().subject_name(_name("scalerl run")).issuer_name(ca.subject)
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(san, critical=False)
          .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
          .sign(ca_key, hashes.SHA256()))
  out = {n: os.path.join(d, f"{n}.pem") for n in ("ca", "cert", "key", "other_ca")}
  for n, data in (("ca", _pem(ca)), ("cert", _pem(cert)), ("other_ca", _pem(other)),
                  ("key", key.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))):
    with open(out[n], "wb") as f:
      f.write(data)
  return out
