// Package testcert makes TLS certificates for tests: a certificate for
// 127.0.0.1 signed by itself, as a tls.Certificate and as PEM files.
package testcert

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// SelfSigned returns a certificate for 127.0.0.1 with common name cn,
// signed by itself (a CA of its own, for servers and clients alike), valid
// for an hour either side of now. It fails t on any error.
func SelfSigned(t testing.TB, cn string) tls.Certificate {
	t.Helper()
	c, _ := selfSigned(t, cn, "")
	return c
}

// ForName returns a certificate for the DNS name host (and no address)
// with common name cn, signed by itself, as SelfSigned.
func ForName(t testing.TB, cn, host string) tls.Certificate {
	t.Helper()
	c, _ := selfSigned(t, cn, host)
	return c
}

// Files writes SelfSigned's certificate and key for cn as PEM files in a
// directory of t's and returns the certificate and the two paths.
func Files(t testing.TB, cn string) (c tls.Certificate, certFile, keyFile string) {
	t.Helper()
	c, key := selfSigned(t, cn, "")
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatalf("testcert: %v", err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, cn+".pem"), filepath.Join(dir, cn+"-key.pem")
	write(t, certFile, &pem.Block{Type: "CERTIFICATE", Bytes: c.Certificate[0]})
	write(t, keyFile, &pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	return c, certFile, keyFile
}

// Pool returns a certificate pool that trusts c.
func Pool(c tls.Certificate) *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(c.Leaf)
	return p
}

// selfSigned makes the certificate: for host, or for 127.0.0.1 when host
// is "".
func selfSigned(t testing.TB, cn, host string) (tls.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("testcert: %v", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IsCA:         true, BasicConstraintsValid: true,
	}
	if host != "" {
		tmpl.IPAddresses, tmpl.DNSNames = nil, []string{host}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatalf("testcert: %v", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatalf("testcert: %v", err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, key
}

func write(t testing.TB, path string, b *pem.Block) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(b), 0o600); err != nil {
		t.Fatalf("testcert: %v", err)
	}
}
