#!/usr/bin/env bash
# Regenerates the TLS test fixtures of crates/nbd/tests/tls.rs and the
# nbd_tls fuzz target (test-only keys: never use them for anything else).
# Valid certificates last 100 years; expired/ expired the day it was made.
#
#   crates/nbd/tests/tls/make.sh
set -euo pipefail
cd "$(dirname "$0")"
rm -rf ca server server2 client rogue expired
mkdir -p ca server server2 client rogue expired
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
sign() { # csr-key subject out ca-dir days ext
    openssl req -new -key "$1" -subj "$2" -out tmp.csr
    printf '%b' "$6" >tmp.ext
    openssl x509 -req -in tmp.csr -CA "$4/ca-cert.pem" -CAkey "$4/ca-key.pem" \
        -set_serial "0x$(openssl rand -hex 8)" -days "$5" -extfile tmp.ext -out "$3" 2>/dev/null
    rm -f tmp.csr tmp.ext
}
ca() { # dir cn
    key "$1/ca-key.pem"
    openssl req -x509 -new -key "$1/ca-key.pem" -subj "/CN=$2" -days 36500 \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
        -out "$1/ca-cert.pem"
}
SERVER_EXT='subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\nextendedKeyUsage=serverAuth\n'
CLIENT_EXT='extendedKeyUsage=clientAuth\n'
ca ca "cvol test CA"
mkdir -p rogue/ca && ca rogue/ca "cvol rogue CA"
for d in server server2; do
    key $d/server-key.pem
    sign $d/server-key.pem "/CN=localhost ($d)" $d/server-cert.pem ca 36500 "$SERVER_EXT"
    cp ca/ca-cert.pem $d/
done
key client/client-key.pem
sign client/client-key.pem /CN=client client/client-cert.pem ca 36500 "$CLIENT_EXT"
key rogue/client-key.pem
sign rogue/client-key.pem /CN=rogue rogue/client-cert.pem rogue/ca 36500 "$CLIENT_EXT"
key expired/client-key.pem
sign expired/client-key.pem /CN=expired expired/client-cert.pem ca -1 "$CLIENT_EXT"
rm -rf rogue/ca
rm -f ca/ca-key.pem
echo "fixtures written to $PWD"
